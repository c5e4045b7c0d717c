"""Rollout on ranks of its own (`rollout.placement = "separate"`) with bounded staleness, on CPU
with gloo: 3 ranks = 1 rollout rank + 2 trainer ranks (TP 2) on the quickstart job."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist_util import REPO, free_port, kill_process_group, run_torchrun
from tests.train.test_train_bf16 import _history

pytestmark = pytest.mark.slow

JOB = "jobs/quickstart_cpu.toml"
COMMON = ["job.name=run", "tracking.backends=[\"mlflow\"]", "platform.collective_timeout_s=60"]
SEPARATE = ["platform.ranks_per_node=3", "rollout.placement=separate", "rollout.ranks=1"]


def _train(out: Path, *overrides: str, nproc: int, timeout: float = 600) -> subprocess.CompletedProcess:
    return run_torchrun("-m mrl train", JOB, f"job.output_dir={out}", *COMMON, *overrides, nproc=nproc,
                        timeout=timeout)


@pytest.mark.parametrize("advantage", ["grpo", "remax"])
def test_separate_on_policy_equals_colocated(tmp_path, advantage):
    """max_staleness 0 on 1 rollout + 2 trainer ranks gives every non-time metric of the 2-rank
    colocated run, step for step (same seeds, prompts, responses and updates), validation
    included (run by the rollout rank when separate). ReMax's greedy baseline is produced with
    its group, on the rollout rank when separate. The ReMax run's bridge sends deltas, verified
    on the rollout rank after every sync (streamed from the exporter: max_staleness 0)."""
    args = ["trainer.total_steps=3", "trainer.val_every_steps=2", "trainer.val_before_train=true", "data.val_prompts=16",
            f"algorithm.advantage={advantage}"]
    delta = ["rollout.weight_sync.mode=delta", "rollout.weight_sync.verify_every_steps=1"] if advantage == "remax" else []
    _train(tmp_path / "colocated", *args, nproc=2)
    _train(tmp_path / "separate", *args, *SEPARATE, *delta, nproc=3)
    colocated, separate = _history(tmp_path / "colocated"), _history(tmp_path / "separate")
    # weight_sync/* (bytes sent, full or delta) differ with the mode and with what is sent when
    # (versions sent only for validation report none), so they are left out here
    keys = [k for k in colocated if not k.startswith(("time/", "throughput/", "memory/", "weight_sync/"))]
    assert "val/reward_mean" in keys and sorted(colocated["val/reward_mean"]) == [0, 2, 3]
    for k in keys:
        assert separate.get(k) == colocated[k], (k, colocated[k], separate.get(k))
    assert separate["rollout/version_lag_max"] == {1: 0.0, 2: 0.0, 3: 0.0}
    # each step reports the bridge sync of the version it was generated with (0, 1, 2)
    assert separate["weight_sync/full"] == {1: 1.0, 2: float(not delta), 3: float(not delta)}
    assert separate["weight_sync/bytes"][1] == separate["weight_sync/bytes_full"][1] > 0


def test_one_step_off_policy_overlaps_lags_by_one_and_learns(tmp_path):
    """max_staleness 1: the lag is exactly 1 after the first step, the rollouts of step t + 1 are
    generated while step t trains (`time/rollout_overlap`), and the quickstart task still learns."""
    out = tmp_path / "async"
    _train(out, "trainer.total_steps=30", "checkpoint.every_steps=0", "rollout.max_staleness=1", *SEPARATE, nproc=3,
           timeout=900)
    h = _history(out)
    assert h["rollout/version_lag_max"] == {s: float(s > 1) for s in range(1, 31)}
    # rollout_overlap of step s + 1: seconds its generation ran while step s trained
    overlapping = [s for s in range(2, 30) if h["time/rollout_overlap"][s + 1] > 0]
    assert len(overlapping) >= 20, overlapping
    rewards = h["reward/mean"]
    first, last = sum(rewards[s] for s in (1, 2, 3)) / 3, sum(rewards[s] for s in (28, 29, 30)) / 3
    assert first <= 0.2 and last >= 0.8, (first, last)


def test_killed_async_run_resumes_exactly(tmp_path):
    """max_staleness 1 with partial rollouts, in bf16 (the weights cross the bridge as bf16 bytes),
    killed (SIGKILL to every process) after its step-2 checkpoint: the resumed run restores the
    two steps of rollouts that were in flight and the partial groups in hand after them, and
    equals the uninterrupted run, metric for metric; the resumed producer starts after them (no
    prompt generated twice). The killed and the resumed run send deltas over the bridge (from the
    sender thread's staged copy), every one verified on the rollout rank: the engine ends
    bit-identical to the full syncs of the whole run, so every rollout, audit and update is the
    same; the resumed trainer holds no copy, so its first sync is full."""
    args = ["trainer.total_steps=5", "checkpoint.every_steps=2", "rollout.max_staleness=1", *SEPARATE,
            "model.dtype=bfloat16",
            "rollout.partial_rollout_tokens=3", "algorithm.dynamic_sampling.generation_batch_prompts=12"]
    _train(tmp_path / "whole", *args, nproc=3)
    args += ["rollout.weight_sync.mode=delta", "rollout.weight_sync.verify_every_steps=1"]

    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "mrl", "train", JOB, f"job.output_dir={out}", *COMMON, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    ckpt = out / "run" / "checkpoints" / "actor" / "step_00000002"
    deadline = time.monotonic() + 300
    while not ckpt.is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    kill_process_group(proc)
    assert ckpt.is_dir(), "the run never reached its step-2 checkpoint"

    resumed = _train(out, *args, nproc=3)
    assert "resumed from step" in resumed.stdout and "2 steps of rollouts restored" in resumed.stdout, resumed.stdout
    whole, again = _history(tmp_path / "whole"), _history(out)
    keys = [k for k in whole if not k.startswith(("time/", "throughput/", "memory/", "weight_sync/"))]
    assert sorted(whole["reward/mean"]) == [1, 2, 3, 4, 5]
    assert all(again.get(k) == whole[k] for k in keys), [k for k in keys if again.get(k) != whole[k]]
    assert sum(whole["rollout/partial_tokens_carried"].values()) > 0
    # steps 1 and 3 report versions 0 and 1 (the killed run), step 5 version 3, the resumed run's
    # first sync (steps 3 and 4 of the resumed run come from the restored queue: versions 1 and 2
    # were sent before the kill)
    assert whole["weight_sync/full"] == {1: 1.0, 3: 1.0, 4: 1.0, 5: 1.0}
    assert {s: v for s, v in again["weight_sync/full"].items() if v} == {1: 1.0, 5: 1.0}, again["weight_sync/full"]
    assert set(again["weight_sync/full"]) <= {1, 3, 4, 5}


def test_a_hung_rollout_rank_is_an_error_naming_it(tmp_path):
    """A rollout rank that stops (SIGSTOP, mid-scoring) is named within the collective timeout."""
    started = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        _train(tmp_path / "hung", "trainer.total_steps=3", *SEPARATE, "platform.collective_timeout_s=15",
               "reward.function=tests/train/stop_rollout.py:score", "reward.workers=1", nproc=3, timeout=300)
    elapsed = time.monotonic() - started
    assert "rollout rank 2 has given no sign of life" in str(failed.value), str(failed.value)[-3000:]
    assert elapsed < 150, elapsed
