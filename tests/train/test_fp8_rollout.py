"""`mrl train` with FP8 rollout (`jobs/quickstart_fp8_cpu.toml`, one rank): the block-FP8 stream
through the whole loop, full and delta, every sync verified by reading the engine's bytes back.
Both runs share one process (`run_jobs.py`)."""
from __future__ import annotations

import pytest

from tests.train.test_train import ONE_RANK, history, run_jobs

pytestmark = pytest.mark.slow


def test_fp8_quickstart_full_and_delta_syncs_give_the_same_run(tmp_path):
    # lr 1e-5: an RL fine-tuning rate, at which few FP8 bytes change per step (the job's 3e-3 moves them all)
    base = f"{ONE_RANK} trainer.total_steps=3 checkpoint.every_steps=0 rollout.weight_sync.verify_every_steps=1 " \
           "actor.optim.lr=1e-5 tracking.backends=[\"mlflow\"]"
    run_jobs("jobs/quickstart_fp8_cpu.toml", tmp_path, base, f"{base} rollout.weight_sync.mode=delta")
    full, delta = history(tmp_path / "run0"), history(tmp_path / "run1")
    # tiny-qwen2 (tied): 2 x (147,456 fp8 bytes + 10 block scales) + (65,536 + 512 + 640) bf16 elements
    assert set(full["weight_sync/bytes"].values()) == {428368.0}
    assert delta["weight_sync/bytes"][1] == 428368.0 and max(delta["weight_sync/bytes"][s] for s in (2, 3)) < 0.5 * 428368
    # the delta engine holds the full sync's bytes after every step, so rollouts and updates are the same
    for key in ("reward/mean", "rollout/logprob_abs_diff_mean", "rollout/kl_k3", "rollout/log_ppl_diff",
                "rollout/chi2_token", "actor/pg_loss"):
        assert full[key] == delta[key], key
    # FP8 weights against the trainer's fp32 ones: a mismatch the audit sees from the first step
    assert full["rollout/logprob_abs_diff_mean"][1] > 1e-3 and full["rollout/kl_k3"][1] > 0
