"""Property tests (hypothesis): identities the estimators, weights and losses must satisfy."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mrl.algos import advantages, correction, dapo, kl, losses

F64 = torch.float64
FAST = settings(max_examples=40, deadline=None)

score = st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(-10, 10, allow_nan=False, width=32))
scored_groups = st.integers(1, 12).flatmap(
    lambda n: st.tuples(st.lists(score, min_size=n, max_size=n),
                        st.lists(st.integers(-3, 3).map(lambda g: g * 1000 + 7), min_size=n, max_size=n)))


def as_tensors(sg):
    s, g = sg
    return torch.tensor(s, dtype=F64), torch.tensor(g, dtype=torch.long)


@FAST
@given(scored_groups)
def test_rloo_is_score_minus_mean_of_others(sg):
    s, g = as_tensors(sg)
    a = advantages.rloo(s, g)
    for i in range(len(s)):
        others = [s[j].item() for j in range(len(s)) if j != i and g[j] == g[i]]
        expected = s[i].item() - sum(others) / len(others) if others else 0.0
        assert math.isclose(a[i].item(), expected, rel_tol=1e-12, abs_tol=1e-9)


@FAST
@given(scored_groups, st.booleans())
def test_grpo_zero_mean_per_group_and_matches_loop_reference(sg, norm_by_std):
    s, g = as_tensors(sg)
    a = advantages.grpo(s, g, norm_by_std=norm_by_std)
    for gid in g.unique():
        sel = g == gid
        xs = s[sel]
        if sel.sum() == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = xs.mean().item(), xs.std(unbiased=True).item()
            assert abs(a[sel].sum().item()) <= 1e-9 * max(1.0, a[sel].abs().max().item())
        expected = (xs - mean) / (std + 1e-6) if norm_by_std else xs - mean
        if xs.max() == xs.min() and sel.sum() > 1:
            expected = torch.zeros_like(xs)  # all-equal group: exactly 0 (no rounding residue)
        torch.testing.assert_close(a[sel], expected, rtol=1e-9, atol=1e-9)


@FAST
@given(scored_groups, st.randoms(use_true_random=False))
def test_group_functions_are_permutation_equivariant_and_id_agnostic(sg, rnd):
    s, g = as_tensors(sg)
    perm = list(range(len(s)))
    rnd.shuffle(perm)
    p = torch.tensor(perm)
    relabelled = g * 31 - 5  # any injective relabelling of the ids
    for fn in (advantages.grpo, advantages.rloo, dapo.keep_groups):
        torch.testing.assert_close(fn(s[p], relabelled[p]), fn(s, g)[p], rtol=1e-12, atol=1e-12)


@FAST
@given(scored_groups)
def test_keep_groups_iff_scores_differ(sg):
    s, g = as_tensors(sg)
    keep = dapo.keep_groups(s, g)
    for i in range(len(s)):
        assert keep[i].item() == (len(set(s[g == g[i]].tolist())) > 1)


def random_batch(seed, b, n, hole_p=0.3):
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, n, generator=gen) > hole_p).to(F64)
    return gen, mask


@FAST
@given(st.integers(0, 10_000), st.integers(1, 6), st.integers(1, 9), st.floats(0.5, 1.0))
def test_whitened_advantages_have_masked_mean_zero_and_unbiased_var_one(seed, b, n, gamma):
    gen, mask = random_batch(seed, b, n)
    rewards = torch.randn(b, n, generator=gen, dtype=F64)
    values = torch.randn(b, n, generator=gen, dtype=F64)
    # The raw values before whitening: REINFORCE++'s returns (a masked token passes G through),
    # GAE's advantages with whitening off.
    ok = mask.bool()
    running, returns = torch.zeros(b, dtype=F64), torch.zeros(b, n, dtype=F64)
    for t in reversed(range(n)):
        running = torch.where(ok[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    raw_gae = advantages.gae(rewards, values, mask, gamma, 0.9, whiten=False)[0]
    for a, raw in ((advantages.reinforce_pp(rewards, mask, gamma), returns),
                   (advantages.gae(rewards, values, mask, gamma, 0.9)[0], raw_gae)):
        sel = mask.bool()
        assert (a[~sel] == 0).all()
        if sel.sum() >= 2:
            x = a[sel]
            assert abs(x.mean().item()) < 1e-9
            var = x.var(unbiased=True).item()
            r = raw[sel].var(unbiased=True).item()
            # (x - mean) * rsqrt(r + 1e-8) has variance r / (r + 1e-8): 1 unless the raw values
            # were (nearly) constant
            assert var == pytest.approx(r / (r + 1e-8), rel=1e-9, abs=1e-12)


@FAST
@given(st.integers(0, 10_000), st.integers(1, 5), st.integers(1, 8), st.floats(0.5, 1.0))
def test_gae_returns_with_lambda_one_are_discounted_returns(seed, b, n, gamma):
    # lam = 1 telescopes: A_t + V_t = r_t + gamma*G_next over valid tokens, whatever V is
    gen, mask = random_batch(seed, b, n)
    rewards = torch.randn(b, n, generator=gen, dtype=F64)
    values = torch.randn(b, n, generator=gen, dtype=F64)
    _, returns = advantages.gae(rewards, values, mask, gamma, 1.0)
    expected = torch.zeros(b, n, dtype=F64)
    for i in range(b):
        g = 0.0
        for k in reversed(range(n)):
            if mask[i, k]:
                g = rewards[i, k].item() + gamma * g
                expected[i, k] = g
    torch.testing.assert_close(returns, expected, rtol=1e-10, atol=1e-10)


@FAST
@given(st.integers(0, 10_000), st.integers(1, 5), st.integers(1, 8), st.sampled_from(["token", "sequence"]),
       st.floats(1.01, 5.0), st.floats(0.5, 3.0))
def test_truncated_weights_never_exceed_threshold(seed, b, n, level, cap, spread):
    gen, mask = random_batch(seed, b, n)
    old = -3 * torch.rand(b, n, generator=gen, dtype=F64)
    roll = old + spread * torch.randn(b, n, generator=gen, dtype=F64)
    w = correction.weights(old, roll, mask, level, cap, "truncate")
    assert (w <= cap).all() and (w >= 0).all() and (w[~mask.bool()] == 0).all()
    m = correction.weights(old, roll, mask, level, (1 / cap, cap), "mask")
    kept = m[m != 0]
    assert ((kept >= 1 / cap) & (kept <= cap)).all() and (m[~mask.bool()] == 0).all()
    if level == "sequence":  # one weight per sequence
        for i in range(b):
            row = w[i][mask[i].bool()]
            assert (row == row[0]).all() if len(row) else True
    wn = correction.weights(old, roll, mask, "token", cap, "truncate", normalize=True)
    if mask.sum() > 0:
        assert math.isclose(wn[mask.bool()].mean().item(), 1.0, rel_tol=1e-12)


@FAST
@given(st.integers(0, 10_000), st.integers(1, 4), st.integers(1, 6), st.floats(0.0, 0.5), st.floats(0.0, 0.5),
       st.one_of(st.none(), st.floats(1.5, 10.0)))
def test_ppo_is_pessimistic_and_clipped_tokens_have_no_gradient(seed, b, n, eps_low, eps_high, clip_c):
    gen, mask = random_batch(seed, b, n)
    old = -2 * torch.rand(b, n, generator=gen, dtype=F64)
    lp = (old + 0.5 * torch.randn(b, n, generator=gen, dtype=F64)).requires_grad_(True)
    adv = torch.randn(b, n, generator=gen, dtype=F64)
    pt, m = losses.ppo(lp, old, adv, mask, eps_low, eps_high, clip_c)
    (g,) = torch.autograd.grad(pt.sum(), lp)
    r = torch.exp(lp.detach() - old)
    sel = mask.bool()
    unclipped = -adv * r
    if clip_c is None:
        assert (pt[sel] >= unclipped[sel] - 1e-12).all()
    else:
        assert (pt[sel & (adv < 0)] <= (-adv * clip_c)[sel & (adv < 0)] + 1e-12).all()
    in_band = (r > 1 - eps_low) & (r < 1 + eps_high)
    clipped = ((adv > 0) & (r > 1 + eps_high)) | ((adv < 0) & (r < 1 - eps_low))
    if clip_c is not None:
        clipped |= (adv < 0) & (r > clip_c)
    assert (g[sel & clipped] == 0).all()
    torch.testing.assert_close(g[sel & in_band], (-adv * r)[sel & in_band], rtol=1e-12, atol=1e-12)
    assert (g[~sel] == 0).all()
    assert 0.0 <= m["clipfrac"].item() <= 1.0


@FAST
@given(st.lists(st.floats(-30, 30), min_size=1, max_size=20))
def test_k3_nonnegative_and_k3_plus_gradient_is_delta(deltas):
    d = torch.tensor(deltas, dtype=F64).requires_grad_(True)
    v = kl.estimate(d, torch.zeros_like(d), "k3+")
    (g,) = torch.autograd.grad(v.sum(), d)
    assert (v >= 0).all() and (v <= 10).all()
    torch.testing.assert_close(g, d.detach(), rtol=0, atol=0)
