"""A resumed run records the spec it now runs (overrides may have changed, e.g. total_steps 3 -> 5).

MLflow params are immutable, so the params keep their first values (the changed keys are listed
in the `mrl.resume_changed_params` tag by `MlflowRun.log_params`); the `spec.toml` artifact, which
`mrl compare` reads before the params, becomes the new spec, and the one it replaces is kept as
`spec_history/spec_before_step_<N>.toml`, so the history of what ran is in the run.
"""
from __future__ import annotations

import os
import tempfile

SPEC = "spec.toml"


def record_resumed_spec(mlflow_run, text: str, start_step: int) -> bool:
    """Make `text` the run's `spec.toml`, keeping a different earlier one; True if it changed."""
    client, run_id = mlflow_run.client, mlflow_run.run_id
    old = None
    if any(a.path == SPEC for a in client.list_artifacts(run_id)):
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        with tempfile.TemporaryDirectory() as tmp:
            with open(client.download_artifacts(run_id, SPEC, tmp), encoding="utf-8") as f:
                old = f.read()
    if old == text:
        return False
    if old is not None:
        mlflow_run.log_text(old, f"spec_history/spec_before_step_{start_step}.toml")
    mlflow_run.log_text(text, SPEC)
    mlflow_run.set_tags({"mrl.spec_changed_at_step": str(start_step)})
    return True
