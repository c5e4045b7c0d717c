"""Fused linear -> log-prob/entropy (torch twin) against the materialised-logits path."""
import pytest
import torch

import mrl_kernels
from kernels_ref import IGNORE, max_err, naive_logprob_entropy


@pytest.fixture(autouse=True)
def _twin(monkeypatch):
    monkeypatch.setenv("MRL_KERNELS_BACKEND", "torch")


def _inputs(n, h, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) * 0.7).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    if n > 3:
        labels[[1, n - 2]] = IGNORE
    return hidden, weight, labels


def _grads(fn, hidden, weight, labels, temperature, **kw):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, ent = fn(h, w, labels, temperature, **kw)
    (logp.double().sum() * 0.7 - ent.double().sum() * 0.3).backward()
    return logp, ent, h.grad, w.grad


def _materialised(h, w, labels, temperature):
    return naive_logprob_entropy(h @ w.T, labels, temperature)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-11), (torch.float32, 3e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("chunks", [(7, 50), (None, None), (64, 1)])
def test_linear_matches_materialised_logits(dtype, tol, chunks):
    hidden, weight, labels = _inputs(40, 24, 333, dtype)
    got = _grads(mrl_kernels.linear_logprob_entropy, hidden, weight, labels, 0.8,
                 chunk_tokens=chunks[0], chunk_vocab=chunks[1])
    want = _grads(_materialised, hidden, weight, labels, 0.8)
    for g, w in zip(got, want):
        assert max_err(g, w) <= tol * max(1.0, w.abs().max().item())
    assert got[2].dtype == got[3].dtype == dtype


def test_linear_gradcheck_float64():
    hidden, weight, labels = _inputs(6, 3, 9, torch.float64, seed=1)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    def fn(a, b):
        return mrl_kernels.linear_logprob_entropy(a, b, labels, 1.3, chunk_tokens=4, chunk_vocab=4)
    assert torch.autograd.gradcheck(fn, (h, w))


def test_linear_partial_requires_grad_and_shapes():
    hidden, weight, labels = _inputs(12, 8, 30, torch.float32)
    h = hidden.clone().requires_grad_()
    logp, ent = mrl_kernels.linear_logprob_entropy(h, weight, labels, chunk_tokens=5, chunk_vocab=7)
    (logp.sum() + ent.sum()).backward()
    assert h.grad is not None and weight.grad is None
    w = weight.clone().requires_grad_()
    logp, ent = mrl_kernels.linear_logprob_entropy(hidden.view(3, 4, 8), w, labels.view(3, 4))
    assert logp.shape == ent.shape == (3, 4)
    ent.sum().backward()
    assert w.grad.shape == weight.shape

    empty = torch.zeros(0, 8, requires_grad=True)
    w = weight.clone().requires_grad_()
    logp, ent = mrl_kernels.linear_logprob_entropy(empty, w, torch.zeros(0, dtype=torch.long))
    (logp.sum() + ent.sum()).backward()
    assert logp.shape == (0,) and empty.grad.shape == (0, 8) and (w.grad == 0).all()


def test_linear_invalid_inputs():
    hidden, weight, labels = _inputs(4, 8, 30, torch.float32)
    with pytest.raises(TypeError, match="share a dtype"):
        mrl_kernels.linear_logprob_entropy(hidden, weight.double(), labels)
    with pytest.raises(ValueError, match="weight"):
        mrl_kernels.linear_logprob_entropy(hidden, weight[:, :5], labels)
    with pytest.raises(ValueError, match="labels must be in"):
        mrl_kernels.linear_logprob_entropy(hidden, weight, torch.tensor([0, 1, 2, 30]))
