"""Which MLflow run a (re)started job logs to.

A job resumed from its own checkpoints continues the MLflow run those checkpoints name. A job
started from another run's checkpoint (`checkpoint.load_from` outside its own checkpoint
directory) is a new run: re-attaching to the source's run id would delete the source's rows of
the later steps and log over them. The new run records where it came from in tags.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def tracking_start(spec: Any, step: int, extra: Mapping[str, Any]) -> tuple[Optional[str], dict[str, str]]:
    """`(resume_run_id, origin_tags)` for a job that restored `extra` at `step` (0: a fresh start)."""
    run_id = extra.get("mlflow_run_id")
    load_from = spec.checkpoint.load_from
    if not step or not load_from or _inside(Path(load_from), Path(spec.checkpoint.dir)):
        return run_id, {}
    origin = {"mrl.loaded_from": str(Path(load_from).resolve()), "mrl.loaded_from_step": str(step)}
    if run_id:
        origin["mrl.loaded_from_run_id"] = str(run_id)
    return None, origin
