"""Rollout-correction weights and mismatch metrics on hand-checkable ratios."""
import math

import pytest
import torch

from mrl.algos import correction as rc
from mrl.algos import losses

F64 = torch.float64
ln = math.log

# token ratios pi_old/pi_roll: row 0 [3, 0.5, 1, (50 masked)], row 1 [1.5, 1.8, (masked), (masked)],
# row 2 fully masked. Sequence ratios: row 0 3*0.5*1 = 1.5, row 1 1.5*1.8 = 2.7.
LR = torch.tensor([[ln(3), ln(0.5), 0.0, ln(50)], [ln(1.5), ln(1.8), 5.0, 5.0], [1.0, 1.0, 1.0, 1.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=F64)
ROLL = torch.full((3, 4), -2.0, dtype=F64)
OLD = ROLL + LR


def w(level, threshold, mode, **kw):
    return rc.weights(OLD, ROLL, MASK, level, threshold, mode, **kw)


def close(a, b):
    torch.testing.assert_close(a, torch.tensor(b, dtype=F64), rtol=1e-14, atol=1e-14)


def test_token_truncate():
    # min(w, 2): [2, 0.5, 1, 0], [1.5, 1.8, 0, 0], zeros
    close(w("token", 2.0, "truncate"), [[2, 0.5, 1, 0], [1.5, 1.8, 0, 0], [0, 0, 0, 0]])


def test_sequence_truncate():
    # row 0: 1.5 on its 3 valid tokens; row 1: min(2.7, 2) = 2
    close(w("sequence", 2.0, "truncate"), [[1.5, 1.5, 1.5, 0], [2, 2, 0, 0], [0, 0, 0, 0]])


def test_token_and_sequence_mask_icepop():
    # keep weights in [0.6, 2.5]: token 3 -> 0, 0.5 -> 0, 1 kept; 1.5 and 1.8 kept
    close(w("token", (0.6, 2.5), "mask"), [[0, 0, 1, 0], [1.5, 1.8, 0, 0], [0, 0, 0, 0]])
    # sequences: 1.5 kept, 2.7 -> 0
    close(w("sequence", (0.6, 2.5), "mask"), [[1.5, 1.5, 1.5, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    # bounds are inclusive: weights exactly 0.5 (exp(ln 0.5) is exact) and 1 survive [0.5, 1]
    got = rc.weights(torch.tensor([[ln(0.5), 0.0]], dtype=F64), torch.zeros(1, 2, dtype=F64),
                     torch.ones(1, 2), "token", (0.5, 1.0), "mask")
    close(got, [[0.5, 1.0]])


def test_normalise_to_mean_one():
    # token level: valid weights 2, 0.5, 1, 1.5, 1.8 -> mean 6.8/5 = 1.36
    close(w("token", 2.0, "truncate", normalize=True),
          [[2 / 1.36, 0.5 / 1.36, 1 / 1.36, 0], [1.5 / 1.36, 1.8 / 1.36, 0, 0], [0, 0, 0, 0]])
    # sequence level: mean over sequences (1.5 + 2)/2 = 1.75, not over tokens ((4.5 + 4)/5 = 1.7)
    close(w("sequence", 2.0, "truncate", normalize=True),
          [[1.5 / 1.75] * 3 + [0], [2 / 1.75, 2 / 1.75, 0, 0], [0, 0, 0, 0]])
    # all weights 0 (every sequence masked out): no normalisation, no NaN
    z = rc.weights(OLD, ROLL, MASK, "sequence", (0.1, 0.2), "mask", normalize=True)
    assert (z == 0).all()


def test_log_ratio_clamped_and_weights_detached():
    old = torch.tensor([[25.0, -25.0]], dtype=F64, requires_grad=True)
    got = rc.weights(old, torch.zeros(1, 2, dtype=F64), torch.ones(1, 2), "token", 1e12, "truncate")
    close(got, [[math.exp(20), math.exp(-20)]])
    assert not got.requires_grad


def test_validation():
    with pytest.raises(ValueError):
        w("token", (0.5, 2.0), "truncate")
    with pytest.raises(ValueError):
        w("token", 2.0, "mask")
    with pytest.raises(ValueError):
        w("token", (2.0, 0.5), "mask")
    with pytest.raises(ValueError):
        w("tokens", 2.0, "truncate")
    with pytest.raises(ValueError):
        w("token", 0.0, "truncate")


def test_weight_metrics():
    m = rc.weight_metrics(OLD, ROLL, MASK, "token", 2.0, "truncate")
    assert m["weight_mean"].item() == pytest.approx(1.36, rel=1e-14)
    assert m["raw_weight_max"].item() == pytest.approx(3.0, rel=1e-14)
    assert m["raw_weight_min"].item() == pytest.approx(0.5, rel=1e-14)
    assert m["changed_token_fraction"].item() == pytest.approx(1 / 5, rel=1e-14)     # the 3
    assert m["changed_sequence_fraction"].item() == pytest.approx(1 / 2, rel=1e-14)  # row 0 of 2
    # ESS fraction mean(w)^2 / mean(w^2) = 1.36^2 / ((4 + 0.25 + 1 + 2.25 + 3.24)/5) = 1.8496 / 2.148
    assert m["ess_fraction"].item() == pytest.approx(1.8496 / 2.148, rel=1e-13)
    m = rc.weight_metrics(OLD, ROLL, MASK, "token", (0.6, 2.5), "mask")
    assert m["changed_token_fraction"].item() == pytest.approx(2 / 5, rel=1e-14)
    empty = rc.weight_metrics(OLD, ROLL, torch.zeros(3, 4), "token", 2.0, "truncate")
    assert all(v.item() == 0.0 for v in empty.values())


def test_mismatch_metrics():
    m = rc.mismatch_metrics(OLD, ROLL, MASK)
    # valid log ratios: ln 3, ln 0.5, 0, ln 1.5, ln 1.8 (sum ln 4.05)
    assert m["kl"].item() == pytest.approx(-ln(4.05) / 5, rel=1e-14)
    # k3: sum(r - 1 - ln r) = (3 + 0.5 + 1 + 1.5 + 1.8) - 5 - ln 4.05 = 2.8 - ln 4.05
    assert m["k3_kl"].item() == pytest.approx((2.8 - ln(4.05)) / 5, rel=1e-14)
    # per sequence mean lp_roll - mean lp_old = -mean lr: row 0 -ln(1.5)/3, row 1 -ln(2.7)/2
    d0, d1 = -ln(1.5) / 3, -ln(2.7) / 2
    assert m["log_ppl_diff"].item() == pytest.approx((d0 + d1) / 2, rel=1e-14)
    assert m["log_ppl_abs_diff"].item() == pytest.approx((abs(d0) + abs(d1)) / 2, rel=1e-14)
    # chi2 token: mean(r^2) - 1 = (9 + 0.25 + 1 + 2.25 + 3.24)/5 - 1 = 2.148
    assert m["chi2_token"].item() == pytest.approx(2.148, rel=1e-14)
    # chi2 seq: mean(1.5^2, 2.7^2) - 1 = (2.25 + 7.29)/2 - 1 = 3.77
    assert m["chi2_seq"].item() == pytest.approx(3.77, rel=1e-14)
    assert all(v.item() == 0.0 for v in rc.mismatch_metrics(OLD, ROLL, torch.zeros(3, 4)).values())


def test_weights_plug_into_policy_loss():
    # weights scale both the per-token loss and its gradient
    cw = w("token", 2.0, "truncate")
    lp = torch.zeros(3, 4, dtype=F64, requires_grad=True)
    pt, _ = losses.ppo(lp, torch.zeros(3, 4, dtype=F64), torch.ones(3, dtype=F64), MASK, 0.2, 0.2, weights=cw)
    (g,) = torch.autograd.grad(pt.sum(), lp)
    torch.testing.assert_close(pt, -cw, rtol=0, atol=0)
    torch.testing.assert_close(g, -cw, rtol=0, atol=0)
