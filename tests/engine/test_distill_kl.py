"""The full-vocabulary reverse KL (mrl.engine.distill_kl) equals torch's log-softmax KL, value and
gradient, with padding columns; the TP2 split is checked in tests/engine/test_distill_kl_dist.py."""
from __future__ import annotations

import torch

from mrl.engine.distill_kl import reverse_kl


def naive(student, teacher, temperature):
    ls = torch.log_softmax(student.double() / temperature, -1)
    lt = torch.log_softmax(teacher.double() / temperature, -1)
    return (ls.exp() * (ls - lt)).sum(-1)


def test_reverse_kl_value_and_gradient_equal_torch():
    g = torch.Generator().manual_seed(0)
    for temperature in (1.0, 0.7):
        s = (torch.randn(5, 40, generator=g) * 2).requires_grad_(True)
        t = torch.randn(5, 40, generator=g) * 2
        w = torch.randn(5, generator=g)
        got = reverse_kl(s, t, temperature)
        (got * w).sum().backward()
        s2 = s.detach().clone().requires_grad_(True)
        want = naive(s2, t, temperature)
        (want * w.double()).sum().backward()
        assert ((got.double() - want).abs() / want.abs().clamp(min=1)).max() < 1e-6   # float32, relative
        assert (s.grad.double() - s2.grad).abs().max() < 1e-6
        assert (reverse_kl(t, t, temperature)).abs().max() < 1e-6   # a model against itself


def test_padding_columns_contribute_nothing():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(3, 10, generator=g)
    t = torch.randn(3, 10, generator=g)
    pad = torch.full((3, 6), float("-inf"))
    s_pad = torch.cat([s, pad], -1).requires_grad_(True)
    got = reverse_kl(s_pad, torch.cat([t, pad], -1))
    got.sum().backward()
    assert (got.double() - naive(s, t, 1.0)).abs().max() < 1e-6
    assert torch.isfinite(s_pad.grad).all() and s_pad.grad[:, 10:].abs().max() == 0
