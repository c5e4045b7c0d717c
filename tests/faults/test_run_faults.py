"""Fault battery, runs and disks (one CPU rank): unwritable output and checkpoint directories are
one line before any training, SIGTERM marks the MLflow run KILLED, and a trainer killed outright
after its first checkpoint leaves no process behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from mrl.checkpoint import store
from mrl.errors import UserError
from tests.dist_util import REPO

ONE_RANK = ["platform.ranks_per_node=1", "parallel.tensor=1"]


def train_cmd(out: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "mrl", "train", "jobs/quickstart_cpu.toml", *ONE_RANK, f"job.output_dir={out}",
            "job.name=run", *overrides]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def test_room_and_writability_are_checked_up_front(tmp_path):
    store.check_writable(tmp_path / "a" / "b", 1, "checkpoint.dir")   # created, probed, removed
    assert list((tmp_path / "a" / "b").iterdir()) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match=r"^checkpoint.dir: .*/file/ckpt is not writable \(Not a directory\)$"):
        store.check_writable(tmp_path / "file" / "ckpt", 0, "checkpoint.dir")
    with pytest.raises(UserError, match=r"GiB free; one checkpoint of this model needs about 1048576.00 GiB"):
        store.check_writable(tmp_path, 2**50, "checkpoint.dir")


@pytest.mark.slow
@pytest.mark.parametrize("key", ["job.output_dir", "checkpoint.dir"])
def test_unwritable_directories_fail_before_training_in_one_line(tmp_path, key):
    (tmp_path / "file").write_text("x")
    bad = f"{key}={tmp_path / 'file' / 'sub'}"
    out = tmp_path if key != "job.output_dir" else None
    cmd = train_cmd(out or tmp_path, bad) if key != "job.output_dir" else train_cmd(tmp_path, "trainer.total_steps=1")
    if key == "job.output_dir":
        cmd = [c for c in cmd if not c.startswith("job.output_dir=")] + [bad]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "is not writable (Not a directory)" in errors[0] and key in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


def runs_in(out: Path):
    """The MLflow runs of the store the job used (one per output directory, or per run directory)."""
    from mlflow.tracking import MlflowClient

    for db in (out / "mlflow.db", out / "run" / "mlflow.db"):
        if db.exists():
            client = MlflowClient(f"sqlite:///{db}")
            runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
            if runs:
                return runs, client
    raise AssertionError(f"no MLflow run under {out}")


@pytest.mark.slow
def test_sigterm_marks_the_run_killed_and_sigkill_leaves_no_process(tmp_path):
    cmd = train_cmd(tmp_path, "checkpoint.every_steps=1", "trainer.total_steps=50", "tracking.backends=[\"mlflow\"]")
    # SIGTERM after the first checkpoint: the run unwinds and MLflow says KILLED
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ckpt = tmp_path / "run/checkpoints/actor/step_00000001/manifest.json"
    try:
        deadline = time.monotonic() + 240
        while not ckpt.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert ckpt.exists(), proc.stderr.read() if proc.poll() is not None else "no checkpoint in time"
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "expected reward workers"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr.read()[-2000:]
    [run], client = runs_in(tmp_path)
    assert run.info.status == "KILLED"
    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    # SIGKILL after the next checkpoint: every process it started goes with it
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        nxt = tmp_path / "run/checkpoints/actor/step_00000003/manifest.json"   # resumed at 1 or 2: one more save
        deadline = time.monotonic() + 240
        while not nxt.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert nxt.exists()
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children):
        time.sleep(0.2)
    left = [(p.pid, p.name()) for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"orphans: {left}"
    # the resumed run re-logged the steps the SIGTERM'd one logged after its checkpoint: one row each
    rows = [m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")]
    assert len(rows) == len(set(rows)) >= 3, f"duplicate metric rows: {sorted(rows)}"
