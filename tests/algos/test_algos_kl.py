"""KL estimators (values and gradients) and KL controllers."""
import math

import pytest
import torch

from mrl.algos import kl

F64 = torch.float64


def t(x):
    return torch.tensor(x, dtype=F64)


# delta = lp - ref for lp = [0.5, -0.5, 0, 30, -25], ref = 0
LP = [0.5, -0.5, 0.0, 30.0, -25.0]


def value_and_grad(kind, lp=LP):
    x = t(lp).requires_grad_(True)
    y = kl.estimate(x, torch.zeros_like(x), kind)
    (g,) = torch.autograd.grad(y.sum(), x)
    return y.detach(), g


def test_k1_abs_k2_are_not_clamped():
    v, g = value_and_grad("k1")
    assert v.tolist() == LP and g.tolist() == [1.0] * 5
    v, g = value_and_grad("abs")
    assert v.tolist() == [0.5, 0.5, 0.0, 30.0, 25.0] and g.tolist() == [1.0, -1.0, 0.0, 1.0, -1.0]
    v, g = value_and_grad("k2")
    # delta^2/2 = [0.125, 0.125, 0, 450, 312.5]; gradient delta
    assert v.tolist() == [0.125, 0.125, 0.0, 450.0, 312.5] and g.tolist() == LP


def test_k3_values_clamps_and_gradient():
    v, g = value_and_grad("k3")
    # exp(-d) + d - 1: d=0.5 -> e^-0.5 - 0.5 = 0.10653065971263342; d=-0.5 -> e^0.5 - 1.5 = 0.14872127070012814
    # d=30 -> d clamped to 20: e^-20 + 19 -> result clamped to 10; d=-25 -> clamped -20: e^20 - 21 -> 10
    expected = [math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5, 0.0, 10.0, 10.0]
    torch.testing.assert_close(v, t(expected), rtol=1e-15, atol=0)
    # gradient 1 - exp(-d) inside the clamps, 0 where a clamp is active
    torch.testing.assert_close(g, t([1 - math.exp(-0.5), 1 - math.exp(0.5), 0.0, 0.0, 0.0]), rtol=1e-15, atol=0)


def test_k3_plus_has_k3_value_and_k2_gradient():
    v3, _ = value_and_grad("k3")
    v, g = value_and_grad("k3+")
    torch.testing.assert_close(v, v3, rtol=1e-15, atol=0)
    assert g.tolist() == LP  # d(delta^2/2)/d lp = delta, even where k3 is clamped
    # gradient with respect to the reference is -delta
    ref = torch.zeros(5, dtype=F64, requires_grad=True)
    (gr,) = torch.autograd.grad(kl.estimate(t(LP), ref, "k3+").sum(), ref)
    assert gr.tolist() == [-x for x in LP]


def test_aliases_and_other_plus_variants():
    for a, b in [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3"), ("low_var_kl+", "k3+"), ("mse+", "k2")]:
        va, ga = value_and_grad(a)
        vb, gb = value_and_grad(b)
        assert va.tolist() == vb.tolist() and ga.tolist() == gb.tolist(), (a, b)
    v, g = value_and_grad("k1+")
    assert v.tolist() == LP and g.tolist() == LP
    v, g = value_and_grad("abs+")
    assert v.tolist() == [0.5, 0.5, 0.0, 30.0, 25.0] and g.tolist() == LP


def test_unknown_kind():
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl.estimate(t([0.0]), t([0.0]), "k4")


def test_mean_per_sequence_skips_fully_masked():
    # rows: mean(1, 3) = 2; mean(2) = 2; row 2 fully masked -> mean 2
    x = t([[1.0, 3.0, 99.0], [2.0, 99.0, 99.0], [99.0, 99.0, 99.0]])
    m = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert kl.mean_per_sequence(x, m).item() == 2.0


def test_adaptive_controller():
    c = kl.AdaptiveController(0.1, target=6.0, horizon=10000)
    # kl 9: error clip(9/6 - 1 = 0.5) = 0.2; mult 1 + 0.2*256/10000 = 1.00512
    assert c.update(9.0, 256) == pytest.approx(0.1 * 1.00512, rel=1e-15)
    # kl 5.4: error 5.4/6 - 1 = -0.1; mult 1 - 0.1*100/10000 = 0.999
    assert c.update(5.4, 100) == pytest.approx(0.1 * 1.00512 * 0.999, rel=1e-14)
    f = kl.FixedController(0.05)
    assert f.update(100.0, 10) == 0.05 and f.value == 0.05


def test_k3_is_accurate_for_tiny_delta_in_float32():
    # k3 ~ delta^2/2 for small delta; the direct form exp(-d) + d - 1 returns 0 here in float32
    d = torch.tensor([1e-5, -1e-4], dtype=torch.float32)
    v = kl.estimate(d, torch.zeros_like(d), "k3")
    torch.testing.assert_close(v, torch.tensor([5e-11, 5e-9]), rtol=1e-3, atol=0)
