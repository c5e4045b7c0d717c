"""Peak temporary memory of the twins on CPU (deterministic storage accounting, see
mrl_kernels.memtrack): the fused linear path is bounded by its tile, and the logits-level twin
never holds an fp32 [N, V] tensor, in the forward or the backward pass."""
import pytest
import torch

import mrl_kernels
import mrl_kernels.linear_logprob as llp
import mrl_kernels.logprob as lp
from mrl_kernels.memtrack import PeakMemory


@pytest.fixture(autouse=True)
def _twin(monkeypatch):
    monkeypatch.setenv("MRL_KERNELS_BACKEND", "torch")


def _eager(hidden, weight, labels, temperature):
    logp_all = torch.log_softmax((hidden @ weight.T).float() / temperature, dim=-1)
    p = logp_all.exp()
    return logp_all.gather(1, labels[:, None])[:, 0], -(p * logp_all).sum(-1)


def _peak_fwd_bwd(fn, *args, **kw):
    hidden, weight = args[0].clone().requires_grad_(), args[1].clone().requires_grad_()
    with PeakMemory("cpu") as pm:
        logp, ent = fn(hidden, weight, *args[2:], **kw)
        (logp.sum() + 0.5 * ent.sum()).backward()
    return pm.peak


def test_memtrack_counts_what_it_should():
    x = torch.randn(256, 256)
    with PeakMemory("cpu") as pm:
        a = x * 2          # 256 KiB, alive to the end
        b = a.exp()        # 256 KiB, freed below
        del b
        c = a[:10]         # a view: no new storage
        a.mul_(3)          # in place: no new storage
    assert pm.peak == 2 * 256 * 256 * 4
    del a, c


def test_linear_path_is_bounded_by_its_tile():
    n, h, v, ct, cv = 512, 32, 4096, 64, 512
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.1
    labels = torch.randint(0, v, (n,), generator=g)
    fused = _peak_fwd_bwd(mrl_kernels.linear_logprob_entropy, hidden, weight, labels, 0.9,
                          chunk_tokens=ct, chunk_vocab=cv)
    eager = _peak_fwd_bwd(_eager, hidden, weight, labels, 0.9)
    f32 = 4
    grads = (n * h + v * h) * f32                    # the gradients themselves (outputs)
    accumulators = n * h * f32 + cv * h * f32        # fp32 grad_hidden and one weight-grad block
    tile = ct * cv * f32
    assert fused <= grads + accumulators + 8 * tile + 64 * n, (fused, tile)
    assert fused * 8 <= eager, (fused, eager)        # the GPU target, on CPU
    assert eager >= 3 * n * v * f32                  # eager really holds several [N, V] tensors


def test_default_tile_respects_budget():
    ct, cv = llp.tile_shape(16384, 152064, torch.device("cuda"))
    assert cv == llp.CHUNK_VOCAB and ct * cv <= llp.TILE_ELEMENTS_CUDA
    ct, cv = llp.tile_shape(16384, 152064, torch.device("cpu"))
    assert ct * cv <= llp.TILE_ELEMENTS_CPU
    assert llp.tile_shape(3, 10, torch.device("cpu")) == (3, 10)


def test_logits_twin_has_no_full_fp32_temporary(monkeypatch):
    n, v, rows = 512, 4096, 64
    monkeypatch.setattr(lp, "TWIN_CHUNK_ELEMENTS", rows * v)
    x = torch.randn(n, v, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    with PeakMemory("cpu") as pm:
        logp, ent = mrl_kernels.logprob_entropy(x, labels, 0.8)
        (logp.sum() + ent.sum()).backward()
    grad_bytes = n * v * 2                           # the bf16 gradient (an output)
    chunk_fp32 = rows * v * 4
    temporaries = pm.peak - grad_bytes
    assert temporaries <= 6 * chunk_fp32, temporaries
    assert temporaries < n * v * 4 / 1.3             # far from one fp32 [N, V] tensor
