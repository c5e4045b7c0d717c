"""Fault battery, `mrl train` end to end (one CPU rank): a run whose latest checkpoint was saved
without optimizer state and then truncated resumes from the previous step, saying each in one
line, and trains on."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.dist_util import REPO

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def train(out, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mrl", "train", "jobs/quickstart_cpu.toml", "platform.ranks_per_node=1",
           "parallel.tensor=1", f"job.output_dir={out}", "job.name=run", "tracking.backends=[]",
           "checkpoint.every_steps=1", "checkpoint.keep_last=3", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.mark.slow
def test_truncated_latest_checkpoint_without_optimizer_resumes_from_the_previous_step(tmp_path):
    train(tmp_path, "trainer.total_steps=2", "checkpoint.save_optimizer=false")
    actor = tmp_path / "run/checkpoints/actor"
    shard = sorted((actor / "step_00000002").glob("*.distcp"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    proc = train(tmp_path, "trainer.total_steps=3")
    lines = proc.stderr.splitlines()
    damaged = [line for line in lines if "is damaged" in line]
    fresh = [line for line in lines if "no optimizer state" in line]
    assert len(damaged) == 1 and "step_00000002" in damaged[0] and "truncated" in damaged[0] \
        and "resuming from step_00000001" in damaged[0], proc.stderr[-3000:]
    assert len(fresh) == 1 and "optimizer starts fresh" in fresh[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert (actor / "latest").read_text().strip() == "step_00000003"
    assert (actor / "step_00000002.damaged").is_dir() and (actor / "step_00000002/manifest.json").is_file()
    print(damaged[0])
    print(fresh[0])
