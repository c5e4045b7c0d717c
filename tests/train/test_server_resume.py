"""Server mode (`rollout.mode = "server"`) with over-sampling, killed with partial trajectories in
flight, resumes exactly: fp32 and bf16, one rank, the hf server engine (`HFAsyncEngine`, whose
scheduler is deterministic; vLLM's engine core cuts aborted requests where wall-clock time left
them, so two uninterrupted vLLM runs already differ and exact resume cannot be shown with it)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist_util import REPO, free_port, run_torchrun
from tests.train.test_train_bf16 import _history

pytestmark = pytest.mark.slow

JOB = "jobs/quickstart_cpu.toml"
# 4 groups of 4 per step, ceil(1.25 x 4) = 5 submitted; at most 6 requests run, and about two
# prompts' worth of tokens are admitted per scheduler step, so when the 4th group finishes the
# others are at different points: some aborted with tokens, carried (max_staleness 1) and
# continued next step
ARGS = ["job.name=run", "tracking.backends=[\"mlflow\"]", "platform.ranks_per_node=1", "parallel.tensor=1",
        "rollout.mode=server", "rollout.over_sample_rate=0.25", "rollout.max_staleness=1", "rollout.max_num_seqs=6",
        "rollout.max_num_batched_tokens=64", "rollout.max_response_tokens=16", "data.prompts_per_step=4",
        "rollout.responses_per_prompt=4", "trainer.total_steps=4", "checkpoint.every_steps=2"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_killed_server_mode_run_with_partial_trajectories_resumes_exactly(tmp_path, dtype):
    """Killed (SIGKILL to the launch and its processes) after its step-2 checkpoint, which holds
    aborted trajectories with tokens: the resumed run restores them, continues them in step 3, and
    logs every metric the uninterrupted run logs, step for step (wall-clock readings aside)."""
    args = [*ARGS, f"model.dtype={dtype}"]
    run_torchrun("-m mrl train", JOB, f"job.output_dir={tmp_path / 'whole'}", *args, nproc=1, timeout=600)

    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "mrl", "train", JOB, f"job.output_dir={out}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    ckpt = out / "run" / "checkpoints" / "actor" / "step_00000002"
    deadline = time.monotonic() + 400
    while not ckpt.is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert ckpt.is_dir(), "the run never reached its step-2 checkpoint"
    assert not (out / "run" / "checkpoints" / "actor" / "step_00000004").exists(), "killed too late: the run finished"

    resumed = run_torchrun("-m mrl train", JOB, f"job.output_dir={out}", *args, nproc=1, timeout=600)
    assert "resumed from step 2 of 4; 4 groups in hand restored" in resumed.stdout, resumed.stdout
    whole, again = _history(tmp_path / "whole"), _history(out)
    # wall-clock readings differ between any two runs: stage times, throughput, memory, and the
    # share of the rollout's wall time the engine was busy
    keys = [k for k in whole if not k.startswith(("time/", "throughput/", "memory/")) and k != "rollout/engine_busy"]
    assert sorted(whole["reward/mean"]) == [1, 2, 3, 4]
    assert [k for k in keys if again.get(k) != whole[k]] == []
    # what was in flight at the kill: trajectories aborted in step 2 with tokens, continued in step 3
    assert whole["rollout/aborted"][2] > 0 and whole["rollout/carried"][2] > 0
    assert whole["rollout/partial_tokens_carried"][3] > 0
    assert whole["rollout/version_lag_max"][3] == 1.0
