"""Server mode (`rollout.mode = "server"`) with over-sampling, killed with partial trajectories in
flight, resumes exactly: fp32 and bf16, one process, the hf server engine (`HFAsyncEngine`, whose
scheduler is deterministic; vLLM's engine core cuts aborted requests where wall-clock time left
them, so two uninterrupted vLLM runs already differ and exact resume cannot be shown with it)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist_util import REPO, kill_process_group
from tests.train.test_train_bf16 import _history

pytestmark = pytest.mark.slow

JOB = "jobs/quickstart_cpu.toml"
# 4 groups of 4 per step, ceil(1.25 x 4) = 5 submitted; at most 6 requests run, and about two
# prompts' worth of tokens are admitted per scheduler step, so when the 4th group finishes the
# others are at different points: some aborted with tokens, carried (max_staleness 1) and
# continued next step
ARGS = ["job.name=run", "tracking.backends=[\"mlflow\"]", "platform.ranks_per_node=1", "parallel.tensor=1",
        "platform.cpu_threads=1",
        "rollout.mode=server", "rollout.over_sample_rate=0.25", "rollout.max_staleness=1", "rollout.max_num_seqs=6",
        "rollout.max_num_batched_tokens=64", "rollout.max_response_tokens=16", "data.prompts_per_step=4",
        "rollout.responses_per_prompt=4", "trainer.total_steps=4", "checkpoint.every_steps=2",
        # the quickstart's reward, which the killed run holds once its step-2 checkpoint exists (a
        # held call waits to be killed: the reward timeout outlasts the test's wait; the workers see
        # the hold's variable)
        "reward.function=tests/train/held_reward.py:score", "reward.timeout_s=600",
        "reward.env_allow=[\"MRL_TEST_HOLD_WHEN\"]"]


def _launch(out: Path, *args: str, hold: dict | None = None) -> subprocess.Popen:
    """`mrl train` in one plain process (no torchrun), in a session of its own (killed as a group);
    its output goes to `out`.log. `hold`: the variable that holds its reward (`held_reward.py`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{out}.log", "a") as log:
        return subprocess.Popen([sys.executable, "-m", "mrl", "train", JOB, f"job.output_dir={out}", *args], cwd=REPO,
                                env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(hold or {})},
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc: subprocess.Popen, out: Path) -> str:
    proc.wait(timeout=600)
    text = Path(f"{out}.log").read_text()
    assert proc.returncode == 0, f"mrl train exited {proc.returncode}\n{text[-4000:]}"
    return text


def test_killed_server_mode_run_with_partial_trajectories_resumes_exactly(tmp_path):
    """fp32 and bf16 (the runs of both at once, one process each): killed (SIGKILL to the process
    group) after its step-2 checkpoint, which holds aborted trajectories with tokens, the resumed
    run restores them, continues them in step 3, and logs every metric the uninterrupted run logs,
    step for step (wall-clock readings aside)."""
    dtypes = ("float32", "bfloat16")
    args = {d: [*ARGS, f"model.dtype={d}"] for d in dtypes}
    whole = {d: _launch(tmp_path / d / "whole", *args[d]) for d in dtypes}
    ckpt = {d: tmp_path / d / "killed" / "run" / "checkpoints" / "actor" for d in dtypes}
    # the killed run's reward holds every call once the step-2 checkpoint exists (step 3's scoring)
    # until the kill, so the kill, once `latest` names that checkpoint, cannot come too late
    # however loaded the machine
    killed = {d: _launch(tmp_path / d / "killed", *args[d], hold={"MRL_TEST_HOLD_WHEN": str(ckpt[d] / "step_00000002")})
              for d in dtypes}
    deadline = time.monotonic() + 500   # a failure bound only: the kill waits for the checkpoint
    while killed and time.monotonic() < deadline:
        for d, proc in list(killed.items()):
            latest = ckpt[d] / "latest"
            if (latest.exists() and latest.read_text().strip() == "step_00000002") or proc.poll() is not None:
                kill_process_group(proc)
                del killed[d]
        time.sleep(0.1)
    for d in dtypes:
        assert (ckpt[d] / "step_00000002").is_dir(), f"{d}: the run never reached its step-2 checkpoint"
        assert not (ckpt[d] / "step_00000004").exists(), f"{d}: killed too late, the run had finished"
    resumed = {d: _launch(tmp_path / d / "killed", *args[d]) for d in dtypes}
    for d in dtypes:
        _finish(whole[d], tmp_path / d / "whole")
        out = _finish(resumed[d], tmp_path / d / "killed")
        assert "resumed from step 2 of 4; 4 groups in hand restored" in out, out[-3000:]
        a, b = _history(tmp_path / d / "whole"), _history(tmp_path / d / "killed")
        # wall-clock readings differ between any two runs: stage times, throughput, memory, and
        # the share of the rollout's wall time the engine was busy
        keys = [k for k in a if not k.startswith(("time/", "throughput/", "memory/")) and k != "rollout/engine_busy"]
        assert sorted(a["reward/mean"]) == [1, 2, 3, 4]
        assert [k for k in keys if b.get(k) != a[k]] == [], d
        # what was in flight at the kill: trajectories aborted in step 2 with tokens, continued in step 3
        assert a["rollout/aborted"][2] > 0 and a["rollout/carried"][2] > 0
        assert a["rollout/partial_tokens_carried"][3] > 0
        assert a["rollout/version_lag_max"][3] == 1.0
