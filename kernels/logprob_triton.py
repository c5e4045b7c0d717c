"""Triton kernels for mrl_kernels.logprob (imported lazily; needs triton).

Forward (`_stats_kernel`): one program per (row, vocabulary split) streams the split in
BLOCK_V-wide blocks, keeping an online (m, s, t) triple in fp32 registers: each block's own
max/sum-exp/sum-exp*shift is merged into the running triple by rescaling with exp(m_old - m_new).
The label logit is one scalar load. Logits are read exactly once and nothing of size [N, V] is
written. Depending on MODE the program writes partial statistics (vocab-parallel / split rows),
merges them into a running [4, N] buffer (fused linear path) or writes the final
(logp, entropy, lse, mu).

Backward (`_grad_kernel`): one program per (row, BLOCK_V block) reloads the logits, recomputes
p = exp(z - lse) from the saved fp32 lse/mu of its row and writes the gradient in the logits
dtype (in place over the logits if asked): one read and one write of [N, V], no fp32 copy.

Interpreter (TRITON_INTERPRET=1) notes: every load is converted to fp32 before any arithmetic
(raw bf16 arithmetic misbehaves there), and no tl.dot is used.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mrl_kernels.logprob import combine_partials, finalize

MODE_PARTIAL = 0     # write [4, N, S] statistics of each split
MODE_ACCUMULATE = 1  # merge into a running [4, N] statistics buffer (S must be 1)
MODE_FINALIZE = 2    # write [4, N] (logp, entropy, lse, mu) (S must be 1, no TP group)


@triton.jit
def _merge(m_a, s_a, t_a, m_b, s_b, t_b):
    """Merge two (max, sum exp(z - max), sum exp(z - max) * (z - max)) triples.

    A triple with s == 0 (nothing seen yet, or an all -inf block) has m = -inf; the where()s
    keep 0 * inf out of the arithmetic so fully masked rows stay finite.
    """
    m = tl.maximum(m_a, m_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    a = tl.exp(m_a - m_safe)
    b = tl.exp(m_b - m_safe)
    t = a * (t_a + tl.where(s_a > 0, m_a - m, 0.0) * s_a) + b * (t_b + tl.where(s_b > 0, m_b - m, 0.0) * s_b)
    s = a * s_a + b * s_b
    return m, s, t


@triton.jit
def _stats_kernel(
    logits_ptr, labels_ptr, out_ptr,
    V, stride_row, plane_stride, vocab_start, inv_temp, ignore_index, split_size, n_splits,
    BLOCK_V: tl.constexpr, MODE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    row_ptr = logits_ptr + row * stride_row
    lo = split * split_size
    hi = tl.minimum(lo + split_size, V)
    offs = tl.arange(0, BLOCK_V)

    m = float("-inf")
    s = 0.0
    t = 0.0
    for start in range(lo, hi, BLOCK_V):
        cols = start + offs
        # Load (any float dtype), convert to fp32 at once, apply the temperature.
        z = tl.load(row_ptr + cols, mask=cols < hi, other=float("-inf")).to(tl.float32) * inv_temp
        bm = tl.max(z, axis=0)
        shifted = z - tl.where(bm == float("-inf"), 0.0, bm)
        e = tl.exp(shifted)
        bs = tl.sum(e, axis=0)
        bt = tl.sum(tl.where(e > 0, e * shifted, 0.0), axis=0)
        m, s, t = _merge(m, s, t, bm, bs, bt)

    # The label logit: one scalar load, only by the program whose split holds the label.
    label = tl.load(labels_ptr + row)
    col = label - vocab_start
    inside = (col >= lo) & (col < hi)
    zl = tl.load(row_ptr + tl.where(inside, col, 0), mask=inside, other=0.0).to(tl.float32) * inv_temp
    zl = tl.where(inside, zl, 0.0)

    if MODE == 0:  # partial statistics, layout [4, N, n_splits]
        base = out_ptr + row * n_splits + split
        tl.store(base, m)
        tl.store(base + plane_stride, s)
        tl.store(base + 2 * plane_stride, t)
        tl.store(base + 3 * plane_stride, zl)
    elif MODE == 1:  # merge into running statistics [4, N]
        base = out_ptr + row
        m0 = tl.load(base)
        s0 = tl.load(base + plane_stride)
        t0 = tl.load(base + 2 * plane_stride)
        zl0 = tl.load(base + 3 * plane_stride)
        m, s, t = _merge(m0, s0, t0, m, s, t)
        tl.store(base, m)
        tl.store(base + plane_stride, s)
        tl.store(base + 2 * plane_stride, t)
        tl.store(base + 3 * plane_stride, zl0 + zl)
    else:  # final outputs [4, N]: logp, entropy, lse, mu (same rules as logprob.finalize)
        valid = s > 0
        log_s = tl.log(tl.where(valid, s, 1.0))
        mean_shift = t / tl.where(valid, s, 1.0)
        lse = tl.where(valid, m + log_s, float("-inf"))
        entropy = tl.where(valid, log_s - mean_shift, 0.0)
        mu = tl.where(valid, m + mean_shift, 0.0)
        logp = tl.where(valid & (label != ignore_index), zl - tl.where(valid, lse, 0.0), 0.0)
        base = out_ptr + row
        tl.store(base, logp)
        tl.store(base + plane_stride, entropy)
        tl.store(base + 2 * plane_stride, lse)
        tl.store(base + 3 * plane_stride, mu)


@triton.jit
def _grad_kernel(
    logits_ptr, labels_ptr, lse_ptr, mu_ptr, glogp_ptr, gent_ptr, grad_ptr,
    V, stride_row, stride_grad_row, vocab_start, inv_temp, ignore_index,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    z = tl.load(logits_ptr + row * stride_row + cols, mask=mask, other=float("-inf"))
    z = z.to(tl.float32) * inv_temp
    lse = tl.load(lse_ptr + row)
    mu = tl.load(mu_ptr + row)
    label = tl.load(labels_ptr + row)
    valid = lse > float("-inf")  # lse = -inf marks a fully masked row: all gradients 0
    g_lp = tl.where(valid & (label != ignore_index), tl.load(glogp_ptr + row), 0.0)
    g_h = tl.load(gent_ptr + row)
    p = tl.exp(z - tl.where(valid, lse, float("inf")))
    ent_term = tl.where(p > 0, p * (z - mu), 0.0)
    g = -g_lp * p - g_h * ent_term
    g = tl.where(cols == label - vocab_start, g + g_lp, g)
    tl.store(grad_ptr + row * stride_grad_row + cols, (g * inv_temp).to(grad_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Launch configuration.
# --------------------------------------------------------------------------------------------

_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def default_config(v: int, device: torch.device, phase: str = "forward") -> tuple[int, int]:
    """(BLOCK_V, num_warps) for the forward (statistics) or the backward (gradient) kernel.

    GPU forward: 4096-wide blocks over 4 warps. Measured on one H100 (N=16384, V=152064, bf16,
    `tools/bench/kernels.py --sweep`): 1.71 ms = 87.0% of HBM bandwidth, against 2.01 ms = 74.0%
    over 8 warps. The backward keeps 8 warps at 4096 (16 fp32 values per thread) until a sweep
    says otherwise. Interpreter: one block of up to 1024 columns (the interpreter's cost is per
    operation, so bigger blocks are faster)."""
    if device.type != "cuda":
        return min(triton.next_power_of_2(v), 1024), 1
    block = min(triton.next_power_of_2(v), 4096)
    if phase == "forward":
        return block, 4
    return block, (8 if block >= 2048 else 4)


def _splits(n: int, v: int, block: int, device: torch.device,
            n_splits: int | None) -> tuple[int, int]:
    """(n_splits, split_size): split the vocabulary across programs only when rows are too few
    to fill the GPU (a few rows of a 152k vocabulary would otherwise run on a few SMs)."""
    blocks = triton.cdiv(v, block)
    if n_splits is None:
        if device.type != "cuda":
            n_splits = 1
        else:
            target = 4 * _sm_count(device)
            n_splits = 1 if n >= target else min(blocks, triton.cdiv(target, max(n, 1)))
    n_splits = max(1, min(int(n_splits), blocks))
    split_size = triton.cdiv(blocks, n_splits) * block
    return triton.cdiv(v, split_size), split_size


def _check(logits: torch.Tensor) -> None:
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"the Triton kernels take bf16/fp16/fp32 logits, got {logits.dtype}")
    if logits.stride(-1) != 1:
        raise ValueError("logits must be contiguous along the vocabulary dimension")


# --------------------------------------------------------------------------------------------
# Launchers (same contracts as the twin functions in logprob.py).
# --------------------------------------------------------------------------------------------

def _launch_stats(logits, labels, out, plane_stride, vocab_start, inv_temp, ignore_index, mode,
                  n_splits, split_size, block, num_warps):
    n, v = logits.shape
    _stats_kernel[(n, n_splits)](
        logits, labels, out, v, logits.stride(0), plane_stride, vocab_start, inv_temp,
        ignore_index, split_size, n_splits, BLOCK_V=block, MODE=mode, num_warps=num_warps)


def stats(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, inv_temp: float,
          ignore_index: int = -100, *, block_v: int | None = None, num_warps: int | None = None,
          n_splits: int | None = None) -> torch.Tensor:
    """Statistics [4, N] fp32 (m, s, t, zl) of the vocabulary slice `logits` [N, V_slice]."""
    _check(logits)
    n, v = logits.shape
    block, warps = default_config(v, logits.device)
    block, warps = block_v or block, num_warps or warps
    n_splits, split_size = _splits(n, v, block, logits.device, n_splits)
    out = torch.empty(4, n, n_splits, dtype=torch.float32, device=logits.device)
    if n:
        _launch_stats(logits, labels, out, n * n_splits, vocab_start, inv_temp, ignore_index,
                      MODE_PARTIAL, n_splits, split_size, block, warps)
    return out[..., 0] if n_splits == 1 else combine_partials(out)


def accumulate_stats(running: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                     vocab_start: int, inv_temp: float, ignore_index: int = -100, *,
                     block_v: int | None = None, num_warps: int | None = None,
                     n_splits: int | None = None) -> None:
    """Merge the statistics of `logits` [n, V_chunk] into `running` [4, n] fp32 in place
    (used by the fused linear path, one vocabulary chunk at a time). `running` may be a column
    slice of a larger [4, N] buffer."""
    _check(logits)
    n, v = logits.shape
    if n == 0:
        return
    block, warps = default_config(v, logits.device)
    block, warps = block_v or block, num_warps or warps
    splits, split_size = _splits(n, v, block, logits.device, n_splits)
    if splits == 1 and running.stride(1) == 1:
        _launch_stats(logits, labels, running, running.stride(0), vocab_start, inv_temp,
                      ignore_index, MODE_ACCUMULATE, 1, split_size, block, warps)
        return
    part = stats(logits, labels, vocab_start, inv_temp, ignore_index, block_v=block,
                 num_warps=warps, n_splits=splits)
    running.copy_(combine_partials(torch.stack([running, part], dim=-1)))


def fused_forward(logits: torch.Tensor, labels: torch.Tensor, inv_temp: float,
                  ignore_index: int = -100, *, block_v: int | None = None,
                  num_warps: int | None = None, n_splits: int | None = None) -> torch.Tensor:
    """[4, N] fp32 (logp, entropy, lse, mu) of full-vocabulary logits [N, V] (no TP group).

    With one split per row this is a single kernel launch that also finalises the outputs."""
    _check(logits)
    n, v = logits.shape
    block, warps = default_config(v, logits.device)
    block, warps = block_v or block, num_warps or warps
    splits, split_size = _splits(n, v, block, logits.device, n_splits)
    if splits > 1:
        part = stats(logits, labels, 0, inv_temp, ignore_index, block_v=block, num_warps=warps,
                     n_splits=splits)
        return finalize(part, labels, ignore_index)
    out = torch.empty(4, n, dtype=torch.float32, device=logits.device)
    if n:
        _launch_stats(logits, labels, out, n, 0, inv_temp, ignore_index, MODE_FINALIZE, 1,
                      split_size, block, warps)
    return out


def grad(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, inv_temp: float,
         ignore_index: int, lse: torch.Tensor, mu: torch.Tensor, grad_logp: torch.Tensor,
         grad_entropy: torch.Tensor, out: torch.Tensor | None = None, *,
         block_v: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """Gradient w.r.t. `logits` [N, V_slice] in its dtype; `out` may alias `logits`."""
    _check(logits)
    n, v = logits.shape
    out = torch.empty_like(logits) if out is None else out
    if out.stride(-1) != 1:
        raise ValueError("out must be contiguous along the vocabulary dimension")
    if n == 0:
        return out
    block, warps = default_config(v, logits.device, "backward")
    block, warps = block_v or block, num_warps or warps
    f32 = dict(dtype=torch.float32)
    _grad_kernel[(n, triton.cdiv(v, block))](
        logits, labels, lse.to(**f32).contiguous(), mu.to(**f32).contiguous(),
        grad_logp.to(**f32).contiguous(), grad_entropy.to(**f32).contiguous(), out,
        v, logits.stride(0), out.stride(0), vocab_start, inv_temp, ignore_index,
        BLOCK_V=block, num_warps=warps)
    return out
