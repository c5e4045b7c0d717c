"""The Triton kernels against the torch twin: on CUDA when present, else under TRITON_INTERPRET=1.

Shapes stay small (the interpreter is 30-100x slower than torch) but exercise a vocabulary that
is not a multiple of the block, several blocks per row (online rescaling), vocabulary splits
across programs, slices with a vocab offset, ignored labels, -inf entries and fully masked rows.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("numpy")  # the interpreter needs numpy

import mrl_kernels  # noqa: E402
import mrl_kernels.linear_logprob as llp  # noqa: E402
import mrl_kernels.logprob as lp  # noqa: E402
from kernels_ref import IGNORE, interpreted_kernels, interpreter_usable, make_case, max_err  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION:UserWarning"),
              pytest.mark.skipif(not interpreter_usable(), reason="triton was imported before "
                                 "TRITON_INTERPRET was set; test_triton_fresh_process.py reruns "
                                 "this file in a fresh process")]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Triton vs twin: forward outputs are fp32 from the same fp32 math in a different order;
# gradients are rounded to the logits dtype, so allow one rounding step relative to max |grad|.
FWD_TOL = 5e-5
GRAD_REL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}


@pytest.fixture(scope="module")
def kt():
    return interpreted_kernels()


def _case(dtype, n=48, v=1000, seed=0):
    logits, labels = make_case(n, v, dtype, seed=seed, ignore_rows=(1, 17), dead_rows=(5,),
                               masked_frac=0.15, masked_label_rows=(9,), device=DEVICE)
    logits[11, : v // 2] = float("-inf")
    return logits, labels


def _fwd_bwd(logits, labels, temperature, backend, monkeypatch):
    monkeypatch.setenv("MRL_KERNELS_BACKEND", backend)
    g = torch.Generator().manual_seed(3)
    a = torch.randn(logits.shape[0], generator=g).to(DEVICE)
    b = torch.randn(logits.shape[0], generator=g).to(DEVICE)
    x = logits.clone().requires_grad_()
    logp, ent = mrl_kernels.logprob_entropy(x, labels, temperature)
    (logp * a + ent * b).sum().backward()
    return logp, ent, x.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_public_api_triton_matches_twin(kt, dtype, temperature, monkeypatch):
    logits, labels = _case(dtype)
    t_logp, t_ent, t_grad = _fwd_bwd(logits, labels, temperature, "triton", monkeypatch)
    r_logp, r_ent, r_grad = _fwd_bwd(logits, labels, temperature, "torch", monkeypatch)
    assert t_logp.dtype == torch.float32 and t_grad.dtype == dtype
    assert max_err(t_logp, r_logp) < FWD_TOL and max_err(t_ent, r_ent) < FWD_TOL
    assert torch.isfinite(t_grad).all()
    assert max_err(t_grad, r_grad) <= GRAD_REL[dtype] * r_grad.abs().max().item()
    assert t_logp[5] == 0 and t_ent[5] == 0 and (t_grad[5] == 0).all()  # dead row
    assert t_logp[9] == float("-inf")                                    # masked label


@pytest.mark.parametrize("dtype", DTYPES)
def test_small_blocks_and_vocab_splits(kt, dtype):
    """BLOCK_V=128 over V=1000: 8 blocks per row with a ragged tail, and 3 programs per row."""
    logits, labels = _case(dtype, seed=1)
    inv_t = 1 / 0.8
    ref = lp.finalize(lp.twin_stats(logits, labels, 0, inv_t), labels, IGNORE)
    one_split = kt.fused_forward(logits, labels, inv_t, IGNORE, block_v=128, n_splits=1)
    three_splits = kt.fused_forward(logits, labels, inv_t, IGNORE, block_v=128, n_splits=3)
    assert max_err(one_split, ref) < FWD_TOL and max_err(three_splits, ref) < FWD_TOL

    g = torch.Generator().manual_seed(4)
    glp, gh = torch.randn(2, logits.shape[0], generator=g).to(DEVICE)
    lse, mu = ref[2], ref[3]
    want = lp.twin_grad(logits, labels, 0, inv_t, IGNORE, lse, mu, glp, gh)
    got = kt.grad(logits, labels, 0, inv_t, IGNORE, lse, mu, glp, gh, block_v=128)
    assert max_err(got, want) <= GRAD_REL[dtype] * want.abs().max().item()
    in_place = logits.clone()
    kt.grad(in_place, labels, 0, inv_t, IGNORE, lse, mu, glp, gh, out=in_place, block_v=128)
    assert torch.equal(in_place, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_slice_statistics(kt, dtype):
    """Partial statistics of a slice with a vocabulary offset match the twin, and combine."""
    logits, labels = _case(dtype, n=24, v=600, seed=2)
    logits[3, 200:400] = float("-inf")  # the middle slice of row 3 is fully masked
    inv_t = 1.0
    parts = []
    for start in (0, 200, 400):
        piece = logits[:, start:start + 200]
        got = kt.stats(piece, labels, start, inv_t, IGNORE, block_v=64, n_splits=2)
        want = lp.twin_stats(piece, labels, start, inv_t, IGNORE)
        assert max_err(got, want) < FWD_TOL
        parts.append(got)
    combined = lp.finalize(lp.combine_partials(torch.stack(parts, -1)), labels, IGNORE)
    ref = lp.finalize(lp.twin_stats(logits, labels, 0, inv_t), labels, IGNORE)
    assert max_err(combined, ref) < FWD_TOL


def test_accumulate_into_running_statistics(kt):
    logits, labels = _case(torch.float32, n=20, v=500, seed=3)
    running = torch.zeros(4, 30, device=DEVICE)
    running[0] = float("-inf")
    view = running[:, 5:25]                                # a column slice, as the linear path uses
    kt.accumulate_stats(view, logits[:, :256], labels, 0, 1.0, IGNORE, block_v=64)
    kt.accumulate_stats(view, logits[:, 256:], labels, 256, 1.0, IGNORE, block_v=64, n_splits=2)
    want = lp.twin_stats(logits, labels, 0, 1.0, IGNORE)
    assert max_err(running[:, 5:25], want) < FWD_TOL
    assert (running[0, :5] == float("-inf")).all() and (running[1:, 25:] == 0).all()


def test_strided_int32_labels(kt, monkeypatch):
    logits, labels = _case(torch.float32, n=24, v=300, seed=4)
    monkeypatch.setenv("MRL_KERNELS_BACKEND", "torch")
    want = mrl_kernels.logprob_entropy(logits, labels)
    monkeypatch.setenv("MRL_KERNELS_BACKEND", "triton")
    for lab in (labels.int(), torch.stack([labels, torch.zeros_like(labels)], 1)[:, 0]):  # stride 2
        got = mrl_kernels.logprob_entropy(logits, lab)
        assert max_err(got[0], want[0]) < FWD_TOL and max_err(got[1], want[1]) < FWD_TOL


def test_empty_batch(kt, monkeypatch):
    monkeypatch.setenv("MRL_KERNELS_BACKEND", "triton")
    x = torch.randn(0, 300, device=DEVICE, requires_grad=True)
    logp, ent = mrl_kernels.logprob_entropy(x, torch.zeros(0, dtype=torch.long, device=DEVICE))
    (logp.sum() + ent.sum()).backward()
    assert logp.shape == (0,) and x.grad.shape == (0, 300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_path_triton_matches_twin(kt, dtype, monkeypatch):
    g = torch.Generator().manual_seed(5)
    n, h, v = 40, 16, 300
    hidden = torch.randn(n, h, generator=g).to(DEVICE, dtype)
    weight = (torch.randn(v, h, generator=g) * 0.5).to(DEVICE, dtype)
    labels = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    labels[3] = IGNORE
    results = {}
    for backend in ("triton", "torch"):
        monkeypatch.setenv("MRL_KERNELS_BACKEND", backend)
        hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, ent = llp.linear_logprob_entropy(hh, ww, labels, 0.9, chunk_tokens=16, chunk_vocab=128)
        (logp.sum() + 0.5 * ent.sum()).backward()
        results[backend] = (logp, ent, hh.grad, ww.grad)
    for got, want in zip(results["triton"], results["torch"]):
        assert max_err(got, want) <= 5e-5 + GRAD_REL[dtype] * want.abs().max().item()


def test_kernels_compile_for_sm90():
    """The interpreter accepts code that the compiler rejects: compile the real kernels for an
    H100 ahead of time (no GPU needed; Triton ships ptxas). Runs in a fresh interpreter because
    triton's own library functions were decorated in interpreter mode in this process."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("aot_compile_check.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=240)
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "compiled 12 kernels" in proc.stdout
