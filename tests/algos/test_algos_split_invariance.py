"""Split invariance: a mini-batch split over micro-batches and data-parallel ranks gives the gradient
of the whole mini-batch (the bug class of verl issue #7200), and batch statistics computed with
`all_reduce` over simulated ranks equal those of the whole batch.

The simulated trainer does what a real one does: every micro-batch is padded only to its own
longest response, each micro-batch loss is backpropagated and gradients are *summed* over
micro-batches on a rank, then *averaged* over the DP ranks (DDP / FSDP / Megatron default).
"""
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mrl.algos import advantages, correction, kl, losses

F64 = torch.float64
B, T, V, FEAT = 8, 7, 5, 4
NORM = 16.0  # configured max response length for seq-mean-token-sum-norm


def make_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < lengths[:, None]).to(F64)
    mask *= (torch.rand(B, T, generator=g) > 0.2).to(F64)  # holes: multi-turn observations
    mask[2] = 0  # a fully masked response
    return {
        "feats": torch.randn(B, T, FEAT, generator=g, dtype=F64),
        "tokens": torch.randint(V, (B, T), generator=g),
        "mask": mask,
        "adv": torch.randn(B, generator=g, dtype=F64),
        "old_logp": -2 * torch.rand(B, T, generator=g, dtype=F64),
        "ref_logp": -2 * torch.rand(B, T, generator=g, dtype=F64),
        "weights": 0.5 + torch.rand(B, T, generator=g, dtype=F64),
        "old_values": torch.randn(B, T, generator=g, dtype=F64),
        "returns": torch.randn(B, T, generator=g, dtype=F64),
    }


def per_token_loss(kind, w, batch, rows, width):
    """Per-token loss of `rows`, cropped to `width` columns, under the shared parameter `w`."""
    sl = lambda x: x[rows][:, :width]  # noqa: E731
    logits = sl(batch["feats"]) @ w
    logp = torch.log_softmax(logits, -1).gather(-1, sl(batch["tokens"]).unsqueeze(-1)).squeeze(-1)
    mask, old = sl(batch["mask"]), sl(batch["old_logp"])
    adv = batch["adv"][rows]
    if kind == "ppo":
        pt, _ = losses.ppo(logp, old, adv, mask, 0.2, 0.28, 3.0, weights=sl(batch["weights"]))
    elif kind == "gspo":
        pt, _ = losses.gspo(logp, old, adv, mask, 0.2, 0.28)
    elif kind == "cispo":
        pt, _ = losses.cispo(logp, old, adv, mask, None, 4.0)
    elif kind == "sapo":
        pt, _ = losses.sapo(logp, old, adv, mask)
    elif kind in ("gpg", "dro"):
        pt, _ = getattr(losses, kind)(logp, old, adv, mask)
    elif kind in ("dppo_tv", "dppo_kl"):
        pt, _ = getattr(losses, kind)(logp, old, adv, mask, 0.2, 0.28, 3.0)
    elif kind == "geo_mean":
        pt, _ = losses.geo_mean(logp, old, adv, mask, 0.4, 0.4, weights=sl(batch["weights"]))
    elif kind == "reinforce":
        pt, _ = losses.reinforce(logp, old, adv, mask, "sequence", 2.0)
    else:  # value head on the same features: values = logits[..., 0]
        return logits[..., 0], mask
    return pt + 0.1 * kl.estimate(logp, sl(batch["ref_logp"]), "k3+"), mask


def loss_of(kind, w, batch, rows, width, mode, **agg):
    pt, mask = per_token_loss(kind, w, batch, rows, width)
    if kind == "value":
        sl = lambda x: x[rows][:, :width]  # noqa: E731
        loss, _ = losses.value(pt, sl(batch["old_values"]), sl(batch["returns"]), mask, 0.2, mode, **agg)
        return loss
    return losses.aggregate(pt, mask, mode, **agg)


def full_gradient(kind, batch, mode, w0):
    w = w0.clone().requires_grad_(True)
    loss_of(kind, w, batch, list(range(B)), T, mode, norm=NORM).backward()
    return w.grad


def split_gradient(kind, batch, mode, w0, ranks, *, use_global=True, dp_scale=True, norm=NORM):
    """Sum over micro-batches, average over ranks. `ranks` = [[rows of micro-batch, ...], ...]."""
    mask = batch["mask"]
    n_tokens = mask.sum()                      # all-reduce of mask.sum() in a real trainer
    n_seqs = (mask.sum(-1) > 0).sum()
    per_rank = []
    for micro_batches in ranks:
        w = w0.clone().requires_grad_(True)
        for rows in micro_batches:
            valid_cols = mask[rows].sum(0).nonzero()
            width = int(valid_cols.max()) + 1 if len(valid_cols) else 1  # pad to own longest response
            agg = {"norm": norm}
            if use_global:
                agg.update(global_tokens=n_tokens, global_sequences=n_seqs, dp_size=len(ranks) if dp_scale else 1)
            loss_of(kind, w, batch, rows, width, mode, **agg).backward()
        per_rank.append(torch.zeros_like(w0) if w.grad is None else w.grad.clone())  # a rank may hold no rows
    return torch.stack(per_rank).mean(0)  # DP gradient averaging


SPLITS = {
    "micro_batches_only": [[[0, 1, 2], [3], [4, 5, 6, 7]]],
    "two_ranks_uneven": [[[0], [1, 2, 3]], [[4, 5], [6], [7]]],
    "four_ranks_with_empty_rank": [[[0, 1]], [[2]], [[3, 4, 5]], [[6], [7]]],  # rank 1 holds only row 2
}
KINDS = ["ppo", "gspo", "cispo", "sapo", "gpg", "dppo_tv", "dppo_kl", "geo_mean", "dro", "reinforce", "value"]
# clip_cov and kl_cov are left out: they pick tokens by a covariance over the call (verl's micro-batch)


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("mode", losses.AGG_MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_gradient_invariant_to_micro_batch_and_dp_split(kind, mode, split):
    batch = make_batch(1)
    w0 = torch.randn(FEAT, V, generator=torch.Generator().manual_seed(2), dtype=F64)
    ref = full_gradient(kind, batch, mode, w0)
    got = split_gradient(kind, batch, mode, w0, SPLITS[split])
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", [m for m in losses.AGG_MODES if m != "token-sum"])  # token-sum uses no count
def test_local_counts_break_invariance(mode):
    # the check above can fail: per-call counts (verl's fallback when no global count is passed)
    # make the summed micro-batch gradient differ from the mini-batch gradient, even on one rank
    batch = make_batch(1)
    w0 = torch.randn(FEAT, V, generator=torch.Generator().manual_seed(2), dtype=F64)
    ref = full_gradient("ppo", batch, mode, w0)
    got = split_gradient("ppo", batch, mode, w0, SPLITS["micro_batches_only"], use_global=False)
    assert not torch.allclose(got, ref, rtol=1e-3, atol=1e-6)


def test_missing_dp_size_scales_gradient_by_one_over_dp():
    batch = make_batch(1)
    w0 = torch.randn(FEAT, V, generator=torch.Generator().manual_seed(2), dtype=F64)
    ref = full_gradient("ppo", batch, "token-mean", w0)
    got = split_gradient("ppo", batch, "token-mean", w0, SPLITS["two_ranks_uneven"], dp_scale=False)
    torch.testing.assert_close(got, ref / 2, rtol=1e-10, atol=1e-12)


def test_sum_norm_needs_fixed_norm_when_widths_differ():
    # with norm left to default (the call's padded width), dynamically padded micro-batches disagree
    batch = make_batch(1)
    w0 = torch.randn(FEAT, V, generator=torch.Generator().manual_seed(2), dtype=F64)
    w = w0.clone().requires_grad_(True)
    loss_of("ppo", w, batch, list(range(B)), T, "seq-mean-token-sum-norm").backward()
    got = split_gradient("ppo", batch, "seq-mean-token-sum-norm", w0, SPLITS["two_ranks_uneven"], norm=None)
    assert not torch.allclose(got, w.grad, rtol=1e-3, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), assignment=st.lists(st.integers(0, 5), min_size=B, max_size=B),
       mode=st.sampled_from(losses.AGG_MODES), kind=st.sampled_from(KINDS))
def test_gradient_invariant_to_random_split(seed, assignment, mode, kind):
    # assignment[i] = slot of row i; slots 0-5 = (rank, micro-batch) = (s // 3, s % 3); empty slots skipped
    batch = make_batch(seed)
    w0 = torch.randn(FEAT, V, generator=torch.Generator().manual_seed(seed + 1), dtype=F64)
    ranks = []
    for r in range(2):
        micro = [[i for i in range(B) if assignment[i] == 3 * r + m] for m in range(3)]
        ranks.append([rows for rows in micro if rows])
    ref = full_gradient(kind, batch, mode, w0)
    got = split_gradient(kind, batch, mode, w0, ranks)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------- batch statistics over simulated ranks
class ThreadedAllReduce:
    """Sum over `n` threads acting as DP ranks (same summation order on every rank)."""

    def __init__(self, n):
        self.barrier = threading.Barrier(n)
        self.slots = [None] * n

    def for_rank(self, rank):
        def all_reduce(x):
            self.slots[rank] = x.clone()
            self.barrier.wait()
            total = sum(self.slots[1:], self.slots[0].clone())
            self.barrier.wait()
            return total
        return all_reduce


def run_ranks(fn, shards):
    ar = ThreadedAllReduce(len(shards))
    out = [None] * len(shards)
    errors = []

    def work(r):
        try:
            out[r] = fn(shards[r], ar.for_rank(r))
        except BaseException as e:  # surface thread failures in the test
            errors.append(e)
            ar.barrier.abort()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(len(shards))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    if errors:
        raise errors[0]
    return out


SHARDS = [[0, 1, 2], [3, 4, 5, 6, 7]]


def test_whitening_with_all_reduce_equals_whole_batch():
    batch = make_batch(3)
    g = torch.Generator().manual_seed(4)
    rewards = torch.randn(B, T, generator=g, dtype=F64)
    values = torch.randn(B, T, generator=g, dtype=F64)
    mask = batch["mask"]
    whole_gae = advantages.gae(rewards, values, mask, 0.99, 0.95)
    whole_rpp = advantages.reinforce_pp(rewards, mask, 0.99)
    parts = run_ranks(lambda rows, ar: (advantages.gae(rewards[rows], values[rows], mask[rows], 0.99, 0.95,
                                                       all_reduce=ar),
                                        advantages.reinforce_pp(rewards[rows], mask[rows], 0.99, all_reduce=ar)),
                      SHARDS)
    torch.testing.assert_close(torch.cat([p[0][0] for p in parts]), whole_gae[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([p[0][1] for p in parts]), whole_gae[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), whole_rpp, rtol=1e-12, atol=1e-12)
    # without all_reduce each shard whitens with its own statistics: different
    local = torch.cat([advantages.reinforce_pp(rewards[r], mask[r], 0.99) for r in SHARDS])
    assert not torch.allclose(local, whole_rpp)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_weight_normalisation_with_all_reduce_equals_whole_batch(level):
    batch = make_batch(5)
    old, mask = batch["old_logp"], batch["mask"]
    roll = old + 0.3 * torch.randn(B, T, generator=torch.Generator().manual_seed(6), dtype=F64)
    whole = correction.weights(old, roll, mask, level, 2.0, "truncate", normalize=True)
    parts = run_ranks(lambda rows, ar: correction.weights(old[rows], roll[rows], mask[rows], level, 2.0, "truncate",
                                                          normalize=True, all_reduce=ar), SHARDS)
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-12, atol=1e-12)
