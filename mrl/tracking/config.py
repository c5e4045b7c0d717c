"""The `tracking` section: console progress and MLflow."""
from __future__ import annotations

from typing import Literal, Optional

from mrl.schema.section import option, section


@section
class TrackingConfig:
    """Where metrics go."""

    backends: tuple[Literal["console", "mlflow", "tensorboard", "wandb"], ...] = option(
        ("console", "mlflow"), help="any of console, mlflow, tensorboard (event files in <run dir>/tensorboard) and "
                                    "wandb (project = tracking.experiment; offline in <run dir>/wandb without "
                                    "WANDB_API_KEY; WANDB_MODE overrides)")
    experiment: str = option("mrl", help="MLflow experiment")
    run_name: Optional[str] = option(None, help="MLflow run name (default: job.name)")
    tracking_uri: Optional[str] = option(None, help="MLflow URI (default: sqlite:///<job.output_dir>/<job.name>/mlflow.db)")
    tags: dict[str, str] = option(factory=dict, help="tags attached to the run (keys MLflow rejects, e.g. with @, are "
                                                     "renamed, said once)")
    retry_s: float = option(30.0, ge=0, help="how long a failed MLflow write (store locked, read-only, down) is retried "
                                            "with backoff before it is dropped, counted (tracking/dropped_writes) and "
                                            "kept in <run dir>/tracking_dropped.jsonl for `mrl track replay`")
    prometheus_port: Optional[int] = option(None, ge=0, le=65535,
                                            help="serve the trainer's live metrics for Prometheus on this port "
                                                 "(rank 0, http://<host>:<port>/metrics; 0: a free port, said at "
                                                 "start); off when unset")
    prometheus_address: str = option("0.0.0.0", help="the address the Prometheus endpoint listens on")
