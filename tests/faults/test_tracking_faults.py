"""Fault battery, tracking: a resumed run has one metric row per step (the re-run steps replace
the rows a killed process logged after its last checkpoint), and a run whose process died
outright is marked KILLED when the job starts again."""
from __future__ import annotations

import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from mrl.tracking.mlflow_run import MlflowRun, default_tracking_uri


def rows(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


@pytest.mark.slow
def test_rerun_steps_after_a_resume_have_one_row_each(tmp_path):
    uri = default_tracking_uri(tmp_path)
    first = MlflowRun(uri, "exp", "job")
    for step in range(1, 6):            # checkpoint at step 3, killed after logging step 5
        first.log_metrics({"reward/mean": step}, step)
    again = MlflowRun(uri, "exp", "job", run_id=first.run_id)
    assert again.forget_steps_after(3) == 2
    for step in (4, 5):                 # the resumed run logs steps 4 and 5 again
        again.log_metrics({"reward/mean": step + 0.5}, step)
    assert rows(uri, first.run_id, "reward/mean") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.5), (5, 5.5)]
    latest = MlflowClient(uri).get_run(first.run_id).data.metrics["reward/mean"]
    assert latest == 5.5
    assert again.forget_steps_after(5) == 0


@pytest.mark.slow
def test_a_run_killed_outright_is_marked_killed_at_the_next_start(tmp_path):
    uri = default_tracking_uri(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = MlflowRun(uri, "exp", "job")
    killed.set_tags({"mrl.pid": dead.stdout.strip()})   # its process is gone (SIGKILL before any checkpoint)
    alive = MlflowRun(uri, "exp", "job")                 # a run of this process: alive, left alone
    other = MlflowRun(uri, "exp", "other-job")           # another job's run: not touched
    other.set_tags({"mrl.pid": dead.stdout.strip()})
    fresh = MlflowRun(uri, "exp", "job")
    assert fresh.end_stale_runs() == [killed.run_id]
    client = MlflowClient(uri)
    assert client.get_run(killed.run_id).info.status == "KILLED"
    assert "its process had died" in client.get_run(killed.run_id).data.tags["mrl.ended_by"]
    assert {client.get_run(r.run_id).info.status for r in (alive, other, fresh)} == {"RUNNING"}
