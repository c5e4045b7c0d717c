"""The torch twin of logprob_entropy against the naive log_softmax/softmax reference."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mrl_kernels
import mrl_kernels.logprob as lp
from kernels_ref import IGNORE, make_case, max_err, naive_logprob_entropy


@pytest.fixture(autouse=True)
def _twin(monkeypatch):
    monkeypatch.setenv("MRL_KERNELS_BACKEND", "torch")


# Forward tolerance (absolute, outputs are fp32) and gradient tolerance relative to max |grad|
# (gradients are written in the logits dtype: bf16 keeps 8 bits of mantissa).
TOL = {torch.float64: (1e-12, 1e-12), torch.float32: (2e-5, 1e-5),
       torch.bfloat16: (2e-5, 8e-3), torch.float16: (2e-5, 1e-3)}


def _loss_weights(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)


def _run(fn, logits, labels, temperature, a, b):
    x = logits.clone().requires_grad_()
    logp, ent = fn(x, labels, temperature)
    (logp.double() * a + ent.double() * b).sum().backward()
    return logp, ent, x.grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_twin_matches_naive(dtype, temperature):
    logits, labels = make_case(33, 257, dtype, ignore_rows=(2, 9), dead_rows=(4,), masked_frac=0.2,
                               masked_label_rows=(6,))
    a, b = _loss_weights(33)
    logp, ent, grad = _run(mrl_kernels.logprob_entropy, logits, labels, temperature, a, b)
    rlogp, rent, rgrad = _run(naive_logprob_entropy, logits, labels, temperature, a, b)
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert logp.dtype == ent.dtype == out_dtype and grad.dtype == dtype
    fwd_tol, grad_rel = TOL[dtype]
    assert max_err(logp, rlogp) <= fwd_tol
    assert max_err(ent, rent) <= fwd_tol
    assert not torch.isnan(grad).any()
    assert max_err(grad, rgrad) <= grad_rel * rgrad.abs().max().item()


def test_gradcheck_float64():
    logits, labels = make_case(6, 11, torch.float64, ignore_rows=(1,), dead_rows=(3,), masked_frac=0.25)
    x = logits.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: mrl_kernels.logprob_entropy(t, labels, 0.8), (x,))


def test_semantics_of_ignored_dead_and_masked_rows():
    logits, labels = make_case(8, 50, torch.float32, ignore_rows=(1,), dead_rows=(2,),
                               masked_label_rows=(3,))
    logits[5, :25] = float("-inf")  # partially masked row
    x = logits.clone().requires_grad_()
    logp, ent = mrl_kernels.logprob_entropy(x, labels)
    rlogp, rent = naive_logprob_entropy(logits, labels)
    # ignored label: logp exactly 0, entropy still the entropy of the row
    assert logp[1].item() == 0.0 and abs(ent[1].item() - rent[1].item()) < 1e-5 and ent[1] > 0
    # fully masked row: no distribution, everything 0
    assert logp[2].item() == 0.0 and ent[2].item() == 0.0
    # masked label: its true log-prob, -inf
    assert logp[3].item() == float("-inf")
    assert max_err(ent, rent) < 2e-5

    (logp[[0, 1, 2, 4, 5, 6, 7]].sum() + ent.sum()).backward()
    assert torch.isfinite(x.grad).all()
    assert (x.grad[2] == 0).all()                     # dead row: no gradient at all
    assert (x.grad[5, :25] == 0).all()                # masked entries get nothing
    x.grad = None
    logp, _ = mrl_kernels.logprob_entropy(x, labels)
    logp[[0, 1, 2, 4]].sum().backward()
    assert (x.grad[1] == 0).all()                     # ignored row: no gradient from logp
    assert abs(x.grad[0].sum().item()) < 1e-5         # d logp / dz sums to 1 - 1 = 0


def test_empty_batch_and_leading_dims():
    x = torch.randn(0, 17, requires_grad=True)
    logp, ent = mrl_kernels.logprob_entropy(x, torch.zeros(0, dtype=torch.long))
    assert logp.shape == ent.shape == (0,)
    (logp.sum() + ent.sum()).backward()
    assert x.grad.shape == (0, 17)

    logits, labels = make_case(12, 31, torch.float32)
    logp, ent = mrl_kernels.logprob_entropy(logits.view(3, 4, 31), labels.view(3, 4), 0.9)
    flogp, fent = mrl_kernels.logprob_entropy(logits, labels, 0.9)
    assert logp.shape == (3, 4) and torch.equal(logp.flatten(), flogp) and torch.equal(ent.flatten(), fent)


def test_non_contiguous_inputs_and_int32_labels():
    logits, labels = make_case(10, 40, torch.float32)
    wide = torch.cat([logits, torch.randn(10, 7)], dim=1)[:, :40]  # row stride 47
    strided_labels = torch.stack([labels, torch.zeros_like(labels)], 1)[:, 0]  # stride 2
    logp, ent = mrl_kernels.logprob_entropy(wide, strided_labels)
    rlogp, rent = mrl_kernels.logprob_entropy(logits.contiguous(), labels)
    assert torch.equal(logp, rlogp) and torch.equal(ent, rent)
    logp32, _ = mrl_kernels.logprob_entropy(logits, labels.int())
    assert torch.equal(logp32, rlogp)


def test_row_chunking_is_exact(monkeypatch):
    logits, labels = make_case(40, 64, torch.float32, ignore_rows=(3,), masked_frac=0.1)
    a, b = _loss_weights(40)
    whole = _run(mrl_kernels.logprob_entropy, logits, labels, 0.9, a, b)
    monkeypatch.setattr(lp, "TWIN_CHUNK_ELEMENTS", 3 * 64)  # 3 rows per chunk, ragged tail
    chunked = _run(mrl_kernels.logprob_entropy, logits, labels, 0.9, a, b)
    for u, v in zip(whole, chunked):
        assert torch.equal(u, v)


def test_slice_statistics_combine_to_full_vocabulary():
    """The arithmetic of vocab parallelism, in one process: stats of slices -> full result."""
    logits, labels = make_case(20, 90, torch.float32, ignore_rows=(0,), masked_frac=0.2)
    logits[7, :30] = float("-inf")  # one slice of row 7 fully masked
    logits[8] = float("-inf")       # dead row
    inv_t = 1 / 1.3
    parts = [lp.twin_stats(logits[:, i:i + 30], labels, i, inv_t) for i in (0, 30, 60)]
    combined = lp.finalize(lp.combine_partials(torch.stack(parts, -1)), labels, IGNORE)
    full = lp.finalize(lp.twin_stats(logits, labels, 0, inv_t), labels, IGNORE)
    assert max_err(combined, full) < 2e-5
    rlogp, rent = naive_logprob_entropy(logits, labels, 1.3)
    assert max_err(combined[0], rlogp) < 2e-5 and max_err(combined[1], rent) < 2e-5


def test_invalid_inputs():
    x, y = torch.randn(4, 10), torch.randint(0, 10, (4,))
    for bad_t in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="temperature"):
            mrl_kernels.logprob_entropy(x, y, bad_t)
    with pytest.raises(ValueError, match="labels must be in"):
        mrl_kernels.logprob_entropy(x, torch.tensor([0, 1, 10, 2]))
    with pytest.raises(ValueError, match="labels shape"):
        mrl_kernels.logprob_entropy(x, y[:3])
    with pytest.raises(TypeError):
        mrl_kernels.logprob_entropy(x.long(), y)
    with pytest.raises(TypeError):
        mrl_kernels.logprob_entropy(x, y.float())
    with pytest.raises(ValueError, match="V >= 1"):
        mrl_kernels.logprob_entropy(torch.randn(4, 0), y)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 6), v=st.integers(1, 40), temperature=st.floats(0.25, 4.0),
       masked=st.floats(0.0, 0.9), scale=st.floats(0.1, 30.0), seed=st.integers(0, 2**16))
def test_twin_property(n, v, temperature, masked, scale, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g, dtype=torch.float64) * scale
    logits[torch.rand(n, v, generator=g) < masked] = float("-inf")
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.2] = IGNORE
    a, b = _loss_weights(n, seed)
    logp, ent, grad = _run(mrl_kernels.logprob_entropy, logits, labels, temperature, a, b)
    rlogp, rent, rgrad = _run(naive_logprob_entropy, logits, labels, temperature, a, b)
    assert max_err(logp, rlogp) < 1e-9 and max_err(ent, rent) < 1e-9
    assert (ent >= 0).all()
    assert not torch.isnan(grad).any() and max_err(grad, rgrad) < 1e-9
