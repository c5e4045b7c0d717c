"""`rollout.router = "driver"`: one router over engine groups whose leaders are different processes
(the hf server engine, 2 ranks, DP 2 of 1 rank each), in one torchrun launch
(`scripts/driver_router.py`):
- part 1, fp32 and bf16: trajectories spread over both leaders, sticky, an abort reaches the
  remote leader, and the results equal the same router over two engines in one process;
- part 2: `mrl train` colocated with rollout.router = "leader" and "driver" (same seeds) logs the
  same metrics (the driver gives each shard's groups in the order submitted, so the batch does
  not depend on which process finished first), the engine/trainer log-prob audit within 1e-6
  (the engines batch other requests together under the driver).
- part 2 also: rollout.router = "leader" with over-sampling (fp32): each rank carries its own
  shard's aborted groups across steps; a run started from the uninterrupted run's step-2
  checkpoint (`checkpoint.load_from`) logs step 3 exactly as it did (every rank's groups in hand
  and sampler position are in the checkpoint, and every rank saves the same common state).
The channel itself: `tests/rollout/test_remote_engine.py`."""
from __future__ import annotations

import json

import pytest

from tests.dist_util import run_torchrun

pytestmark = pytest.mark.slow

AUDIT = ("logprob", "kl_", "chi2", "prob_abs", "log_ppl")
BASE = ("parallel.tensor=1 platform.cpu_threads=1 rollout.mode=server trainer.total_steps=2 checkpoint.every_steps=0 "
        "tracking.backends=[\"console\"] data.prompts_per_step=4 rollout.responses_per_prompt=4 "
        "actor.mini_batch_prompts=2")


# 2 groups of 4 per shard and step, ceil(1.25 x 2) = 3 submitted: one aborted with tokens and carried
OVER = ("rollout.router=leader rollout.over_sample_rate=0.25 rollout.max_staleness=1 rollout.max_num_seqs=6 "
        "rollout.max_num_batched_tokens=64 rollout.max_response_tokens=16 trainer.total_steps=3 "
        "checkpoint.every_steps=2 checkpoint.keep_last=2")


def test_one_router_over_two_leaders_in_two_processes(tmp_path):
    step2 = tmp_path / "run2" / "checkpoints" / "actor" / "step_00000002"
    proc = run_torchrun("tests/train/scripts/driver_router.py", str(tmp_path),
                        f"{BASE} rollout.router=leader checkpoint.every_steps=-1",   # nothing to save
                        f"{BASE} rollout.router=driver", f"{BASE} {OVER}", f"{BASE} {OVER} checkpoint.load_from={step2}",
                        timeout=900)
    out = proc.stdout
    for dtype in ("float32", "bfloat16"):
        assert f"PART1 {dtype} ok: rank 1 served 13 requests" in out, out[-3000:]
    results = {}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            _, i, metrics = line.split(" ", 2)
            results[int(i)] = json.loads(metrics)
    leader, driver, whole, resumed = (results[i] for i in range(4))
    # over-sampling on 2 leaders, step 3 from the step-2 checkpoint: as uninterrupted
    carried = [k for k in whole if not k.startswith(("time/", "throughput/", "memory/")) and k != "rollout/engine_busy"]
    assert "reward/mean" in carried and {k: resumed.get(k) for k in carried} == {k: whole[k] for k in carried}
    assert whole["rollout/partial_tokens_carried"] > 0 and whole["rollout/version_lag_max"] == 1.0
    # megatron's check of the checkpoint's common state across ranks: the groups in hand agree
    assert not [line for line in proc.stderr.splitlines() if "common state dict differs" in line
                and ("rollout_carry" in line or "sampler" in line)], proc.stderr[-3000:]
    keys = [k for k in leader if not k.startswith(("time/", "throughput/", "memory/")) and k != "rollout/engine_busy"]
    # the engines' log-probs of the same tokens: each engine batches both shards' requests together
    # under the driver, its own shard's alone under a leader, so they differ by batch numerics only
    audit = [k for k in keys if k.startswith("rollout/") and any(w in k for w in AUDIT)]
    exact = [k for k in keys if k not in audit]
    assert "reward/mean" in exact and "actor/pg_loss" in exact and "rollout/logprob_abs_diff_max" in audit
    assert {k: driver[k] for k in exact} == {k: leader[k] for k in exact}
    assert all(abs(driver[k] - leader[k]) < 1e-6 for k in audit), {k: (driver[k], leader[k]) for k in audit}
    assert "one router on rank 0 over 2 engine groups" in out
    # rank 1's engine served a share of the driver's trajectories in part 2: 2 steps of 16 trajectories, every other one
    assert "mrl router: this leader's engine served 16 requests for the driver (0 aborted)" in proc.stderr, proc.stderr[-3000:]
