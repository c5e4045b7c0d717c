"""Online DPO (`algorithm.objective = "dpo"`) end to end through `mrl train` on CPU: the quickstart
learns in fp32 and bf16, every loss and pairing runs, and a stopped run resumes exactly."""
from __future__ import annotations

import pytest

from tests.train.resume import assert_resumed_exactly, whole_and_resumed
from tests.train.test_train import ONE_RANK, history, run_jobs

pytestmark = pytest.mark.slow

DPO = "algorithm.objective=dpo tracking.backends=[\"mlflow\"]"


def test_online_dpo_raises_the_quickstart_reward_in_fp32_and_bf16(tmp_path):
    """Best-vs-worst pairs of each group of 8, DPO loss at beta 0.1, on the quickstart's digits
    task: mean reward from ~0.02 to >= 0.8 over the last 5 of 25 steps, in both dtypes (measured:
    fp32 0.035 -> 0.95 at step 13, 1.0 from step 20 with the race sampler; docs/algorithms.md)."""
    base = f"{ONE_RANK} {DPO} checkpoint.every_steps=0 trainer.total_steps=25"
    run_jobs("jobs/quickstart_cpu.toml", tmp_path, base, f"{base} model.dtype=bfloat16", timeout=1500)
    for i in (0, 1):
        h = history(tmp_path / f"run{i}")
        r = h["reward/mean"]
        last = [r[s] for s in sorted(r)[-5:]]
        print(f"run{i}: reward {r[1]:.3f} -> {sum(last) / 5:.3f}")
        assert r[1] <= 0.2 and sum(last) / 5 >= 0.8, r
        assert h["dpo/pairs"][1] >= 1 and 0 <= h["dpo/reward_accuracy"][1] <= 1


def test_dpo_stopped_and_resumed_equals_uninterrupted_in_fp32_and_bf16(tmp_path):
    """One launch, both dtypes: fp32 with 2 mini-batches (the old log-prob pass gives the audit);
    bf16 with IPO, margin pairs and one mini-batch (on-policy: the first pass gives the audit)."""
    variants = {"float32": "", "bfloat16": "algorithm.dpo.loss=ipo algorithm.dpo.pairs=margin "
                                           "algorithm.dpo.margin=0.1 actor.mini_batch_prompts=8"}
    base = f"{ONE_RANK} {DPO} checkpoint.every_steps=2"
    runs = whole_and_resumed("jobs/quickstart_cpu.toml", tmp_path,
                             *(f"{base} model.dtype={dtype} {v}" for dtype, v in variants.items()))
    for dtype, (whole, again) in zip(variants, runs):
        keys = assert_resumed_exactly(whole, again)
        assert "dpo/loss" in keys and "actor/grad_norm" in keys, dtype
        assert max(whole["rollout/logprob_abs_diff_max"].values()) < (1e-4 if dtype == "float32" else 0.1), dtype
        assert all(whole["actor/pass_drift"][s] < 1e-3 for s in whole["actor/pass_drift"]), dtype


def test_simpo_runs_without_a_reference(tmp_path):
    [m] = run_jobs("jobs/quickstart_cpu.toml", tmp_path, f"{ONE_RANK} {DPO} algorithm.dpo.loss=simpo "
                   "algorithm.dpo.gamma=0.5 algorithm.dpo.beta=2 trainer.total_steps=2 checkpoint.every_steps=0")
    assert "time/ref_logprobs" not in m and m["dpo/pairs"] >= 1 and m["actor/updated"] == 1
    assert all(v == v for v in m.values())


def test_dpo_at_dp2_counts_pairs_and_dropped_groups_over_both_ranks(tmp_path):
    """Two data-parallel ranks (gloo): each forms its own groups' pairs; the counts and means span
    both: every one of the 8 groups of step 1 (4 per rank) is paired or dropped (equal scores).
    How many of each follows the responses drawn: 4 and 4 with the hf engine's exponential-race
    sampler (each row's own uniforms; 5 and 3 with torch.multinomial per row, 7 and 1 with the
    inverse CDF it had for a while, the same law each time but another map from seeds to tokens)."""
    from tests.dist_util import run_torchrun

    run_torchrun("-m mrl train", "jobs/quickstart_cpu.toml", "algorithm.objective=dpo", "parallel.tensor=1",
                 "trainer.total_steps=2", f"job.output_dir={tmp_path}", "tracking.backends=[\"mlflow\"]",
                 "checkpoint.every_steps=0", timeout=600)
    h = history(tmp_path / "quickstart-cpu")
    counts = (h["dpo/pairs"][1], h["dpo/groups_dropped"][1])
    assert sum(counts) == 8 and counts == (4, 4), counts
    # actor/loss is the DPO loss: the mean over the 2 optimizer steps of each mini-batch's mean over
    # its pairs, where dpo/loss is the mean over all pairs; they differ by |l1 - l2| |p1 - p2| /
    # (2 (p1 + p2)) for mini-batch losses l and pair counts p: 0.0055 with the race sampler's draws
    # (the 1e-3 bound held for torch.multinomial's); a PPO-style loss would be near 0
    assert h["actor/updates"][1] == 2 and abs(h["actor/loss"][2] - h["dpo/loss"][2]) < 0.02
    assert 0.3 < h["dpo/loss"][2] < 1.0
