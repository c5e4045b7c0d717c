"""Per-token log-prob of the sampled label and entropy of the softmax, fused and vocab-parallel.

For logits `x` (one row per token), temperature `T` and `z = x / T`:

    logp    = z[label] - logsumexp(z)
    entropy = logsumexp(z) - sum_j softmax(z)_j * z_j

Both are computed from four per-row statistics of a vocabulary slice, which is what makes the
computation streamable (one pass over vocabulary blocks) and vocab-parallel (one set of
statistics per tensor-parallel rank, combined with two all-reduces of [N]-sized tensors):

    m  = max_j z_j                      (the shift)
    s  = sum_j exp(z_j - m)
    t  = sum_j exp(z_j - m) * (z_j - m) (shifted, so entropy = log s - t/s has no cancellation)
    zl = z[label] if the label falls in this slice, else 0

Semantics (shared by the Triton kernels and the torch twin in this file):

- Output dtype is float32 for bf16/fp16/fp32 logits (float64 for float64, twin only: gradcheck).
- `labels == ignore_index` (default -100): logp = 0 and no gradient flows from logp for that
  row. Entropy does not depend on the label, so it is computed (and differentiable) as usual;
  callers mask it with their own response mask.
- `-inf` logits are masked vocabulary entries: probability 0, no gradient from entropy. A label
  whose logit is -inf gets logp = -inf (its true value) and a finite gradient.
- A row whose logits are all -inf has no distribution: logp = 0, entropy = 0, and every
  gradient in that row is 0 (it behaves like an ignored, padded row; never NaN).
- +inf or NaN logits are not supported (they produce NaN).
- Labels outside [0, V) other than `ignore_index` are an error on CPU; on CUDA they are not
  checked (that would cost a device sync) and give logp = -logsumexp(z).

The backward pass recomputes probabilities from the logits and two saved fp32 statistics per
row (`lse`, and `mu` = sum_j p_j z_j), so neither pass keeps an fp32 [N, V] tensor around.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from mrl_kernels import _dispatch

IGNORE_INDEX = -100

# The twin processes rows in chunks of about this many elements, so even the CPU path keeps its
# fp32 temporaries bounded (a handful of [rows, V] fp32 tensors of this size).
TWIN_CHUNK_ELEMENTS = 1 << 22

_NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------------
# Helpers shared by both backends: dtype, group, combining statistics, finalising outputs.
# --------------------------------------------------------------------------------------------

def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation/output dtype: float64 for float64 inputs (twin only), float32 otherwise."""
    if dtype == torch.float64:
        return torch.float64
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"logits must be bf16, fp16, fp32 or fp64, got {dtype}")
    return torch.float32


def group_rank_size(group) -> tuple[int, int]:
    """(rank, world size) in `group`; (0, 1) when there is no group or no initialised backend."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _rescale(stats: torch.Tensor, new_max: torch.Tensor) -> torch.Tensor:
    """Re-express (s, t, zl) of `stats` = [4, ...] (rows m, s, t, zl) relative to `new_max`.

    sum exp(z - M) (z - M) = exp(m - M) * (t + (m - M) * s). Terms with s == 0 (an all -inf
    slice, m = -inf) contribute 0 instead of 0 * inf = NaN.
    """
    m, s, t, zl = stats.unbind(0)
    safe_max = torch.where(new_max == _NEG_INF, torch.zeros_like(new_max), new_max)
    alpha = torch.exp(m - safe_max)
    shift = torch.where(s > 0, m - new_max, torch.zeros_like(m))
    return torch.stack([s * alpha, alpha * (t + shift * s), zl])


def combine_partials(stats: torch.Tensor) -> torch.Tensor:
    """Combine statistics of disjoint vocabulary slices along the last dim: [4, N, S] -> [4, N]."""
    new_max = stats[0].amax(-1)
    rest = _rescale(stats, new_max.unsqueeze(-1)).sum(-1)
    return torch.cat([new_max.unsqueeze(0), rest])


def combine_group(stats: torch.Tensor, group) -> torch.Tensor:
    """Combine per-rank statistics [4, N] over the TP group: all-reduce MAX, then one SUM.

    Every rank ends with identical global statistics. The tensors passed to the collectives are
    made contiguous explicitly (gloo can move the wrong bytes for non-contiguous tensors).
    """
    if group_rank_size(group)[1] == 1:
        return stats
    global_max = stats[0].clone().contiguous()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    rest = _rescale(stats, global_max).contiguous()
    dist.all_reduce(rest, op=dist.ReduceOp.SUM, group=group)
    return torch.cat([global_max.unsqueeze(0), rest])


def finalize(stats: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Global statistics [4, N] -> [4, N] rows (logp, entropy, lse, mu), with the masking rules.

    lse = -inf marks a fully masked row; the backward pass relies on that marker.
    """
    m, s, t, zl = stats.unbind(0)
    valid = s > 0
    log_s = torch.log(torch.where(valid, s, torch.ones_like(s)))
    mean_shift = t / torch.where(valid, s, torch.ones_like(s))
    zero = torch.zeros_like(s)
    lse = torch.where(valid, m + log_s, torch.full_like(s, _NEG_INF))
    entropy = torch.where(valid, log_s - mean_shift, zero)
    mu = torch.where(valid, m + mean_shift, zero)
    has_label = valid & (labels != ignore_index)
    logp = torch.where(has_label, zl - torch.where(valid, lse, zero), zero)
    return torch.stack([logp, entropy, lse, mu])


def check_label_tensor(labels: torch.Tensor, x: torch.Tensor, name: str) -> None:
    """labels must be an integer tensor shaped like `x` without its last dimension."""
    if labels.shape != x.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal {name}.shape[:-1] "
                         f"= {tuple(x.shape[:-1])}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")


def _check_labels(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Reject out-of-range labels on CPU (free there); skipped on GPU to avoid a device sync."""
    if labels.is_cuda or labels.numel() == 0:
        return
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        raise ValueError(f"labels must be in [0, {vocab}) or {ignore_index}; got "
                         f"{labels[bad][:5].tolist()}")


# --------------------------------------------------------------------------------------------
# The torch twin. Same contract as the Triton launchers in logprob_triton.py.
# --------------------------------------------------------------------------------------------

def _row_chunks(n: int, v: int):
    rows = max(1, TWIN_CHUNK_ELEMENTS // max(v, 1))
    for start in range(0, n, rows):
        yield start, min(n, start + rows)


def _label_columns(labels: torch.Tensor, vocab_start: int, v: int):
    """Local column of each label and whether it falls in [vocab_start, vocab_start + v)."""
    local = labels - vocab_start
    inside = (local >= 0) & (local < v)
    return torch.where(inside, local, torch.zeros_like(local)), inside


def twin_stats(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, inv_temp: float,
               ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Statistics [4, N] (m, s, t, zl) of the vocabulary slice `logits` [N, V_slice].

    `vocab_start` is the global id of column 0, so only labels inside the slice contribute zl.
    Rows are processed in chunks; the fp32 temporaries are [chunk, V_slice].
    """
    n, v = logits.shape
    cdt = compute_dtype(logits.dtype)
    lowest = torch.finfo(cdt).min
    out = torch.empty(4, n, dtype=cdt, device=logits.device)
    for r0, r1 in _row_chunks(n, v):
        z = logits[r0:r1].to(cdt, copy=True).mul_(inv_temp)
        m = z.amax(-1)
        cols, inside = _label_columns(labels[r0:r1], vocab_start, v)
        zl = torch.where(inside, z.gather(1, cols.unsqueeze(1)).squeeze(1), 0.0)
        # z - m in place; -inf (masked) entries become the most negative finite number, so that
        # exp() gives 0 and exp() * shift gives 0 instead of 0 * inf = NaN.
        shifted = z.sub_(torch.where(m == _NEG_INF, 0.0, m).unsqueeze(-1)).clamp_min_(lowest)
        e = shifted.exp()
        s = e.sum(-1)
        t = e.mul_(shifted).sum(-1)
        out[:, r0:r1] = torch.stack([m, s, t, zl])
    return out


def twin_grad(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, inv_temp: float,
              ignore_index: int, lse: torch.Tensor, mu: torch.Tensor, grad_logp: torch.Tensor,
              grad_entropy: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """d(loss)/d(logits) for the slice, in the logits dtype, from the saved per-row lse and mu.

    grad_z_j = g_logp * (1[j = label] - p_j) - g_H * p_j * (z_j - mu), times 1/T for the logits.
    `out` may alias `logits` (each chunk is read before it is written).
    """
    n, v = logits.shape
    cdt = compute_dtype(logits.dtype)
    lowest = torch.finfo(cdt).min
    out = torch.empty_like(logits) if out is None else out
    valid = lse > _NEG_INF
    lse_safe = torch.where(valid, lse, torch.full_like(lse, float("inf")))  # p = 0 in masked rows
    g_lp = torch.where(valid & (labels != ignore_index), grad_logp.to(cdt), torch.zeros_like(lse))
    g_h = grad_entropy.to(cdt)
    for r0, r1 in _row_chunks(n, v):
        z = logits[r0:r1].to(cdt, copy=True).mul_(inv_temp)
        p = z.sub(lse_safe[r0:r1, None]).exp_()
        # In place, to keep two [chunk, V] temporaries: z becomes p * (z - mu) (masked -inf
        # entries clamped to the lowest finite number, so 0 * (z - mu) is 0, not NaN), then p
        # becomes the gradient.
        ent_term = z.clamp_min_(lowest).sub_(mu[r0:r1, None]).mul_(p)
        g = p.mul_(-g_lp[r0:r1, None]).sub_(ent_term.mul_(g_h[r0:r1, None]))
        cols, inside = _label_columns(labels[r0:r1], vocab_start, v)
        g.scatter_add_(1, cols.unsqueeze(1), torch.where(inside, g_lp[r0:r1], 0.0).unsqueeze(1))
        out[r0:r1] = g.mul_(inv_temp)  # copy_ casts to the logits dtype
    return out


# --------------------------------------------------------------------------------------------
# Autograd and the public entry point.
# --------------------------------------------------------------------------------------------

def _impl(backend: str):
    return _dispatch.triton_module("logprob_triton") if backend == "triton" else None


def forward_stats(backend: str, logits, labels, vocab_start, inv_temp, ignore_index, group):
    """(logp, entropy, lse, mu) [4, N] of the (possibly vocab-parallel) logits."""
    n, v = logits.shape
    _, world = group_rank_size(group)
    if backend == "triton":
        kern = _impl(backend)
        if world == 1:
            return kern.fused_forward(logits, labels, inv_temp, ignore_index)
        stats = kern.stats(logits, labels, vocab_start, inv_temp, ignore_index)
    else:
        stats = twin_stats(logits, labels, vocab_start, inv_temp, ignore_index)
    return finalize(combine_group(stats, group), labels, ignore_index)


def backward_grad(backend: str, logits, labels, vocab_start, inv_temp, ignore_index, lse, mu,
                  grad_logp, grad_entropy, out=None):
    if backend == "triton":
        return _impl(backend).grad(logits, labels, vocab_start, inv_temp, ignore_index, lse, mu,
                                   grad_logp, grad_entropy, out=out)
    return twin_grad(logits, labels, vocab_start, inv_temp, ignore_index, lse, mu, grad_logp,
                     grad_entropy, out=out)


class _LogProbEntropy(torch.autograd.Function):
    """Forward saves only the logits (by reference) and fp32 lse/mu per row; backward recomputes."""

    @staticmethod
    def forward(ctx, logits, labels, inv_temp, ignore_index, group, backend):
        rank, _ = group_rank_size(group)
        vocab_start = rank * logits.shape[1]
        out = forward_stats(backend, logits, labels, vocab_start, inv_temp, ignore_index, group)
        logp, entropy, lse, mu = out.unbind(0)
        ctx.save_for_backward(logits, labels, lse, mu)
        ctx.args = (vocab_start, inv_temp, ignore_index, backend)
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        logits, labels, lse, mu = ctx.saved_tensors
        vocab_start, inv_temp, ignore_index, backend = ctx.args
        grad = None
        if ctx.needs_input_grad[0]:
            grad = backward_grad(backend, logits, labels, vocab_start, inv_temp, ignore_index, lse,
                                 mu, grad_logp.contiguous(), grad_entropy.contiguous())
        return grad, None, None, None, None, None


def check_temperature(temperature: float) -> float:
    """1/temperature, after checking that temperature is a finite positive number."""
    temperature = float(temperature)
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    return 1.0 / temperature


def logprob_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, *,
                    group=None, ignore_index: int = IGNORE_INDEX,
                    backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `labels` and entropy of softmax(logits / temperature), both differentiable.

    logits: [..., V] bf16/fp16/fp32 (fp64: torch twin only). With `group` (a torch.distributed
        ProcessGroup of tensor-parallel ranks) each rank passes its vocabulary slice
        [..., V/tp]; rank r holds global ids [r*V/tp, (r+1)*V/tp). All slices have equal width.
    labels: [...] integer global token ids, or `ignore_index`.
    Returns (logp, entropy), each [...] float32, identical on every rank of `group`.

    The Triton kernel runs for CUDA tensors, the torch twin otherwise (see `MRL_KERNELS_BACKEND`
    in mrl_kernels._dispatch; `backend` = "auto" | "torch" | "triton" overrides both). The vocabulary is never gathered: ranks exchange three [N] fp32
    tensors (max, then sum-of-exp / sum-of-p*z / label logit) in the forward pass and nothing in
    the backward pass, which is local to each rank's slice.
    """
    inv_temp = check_temperature(temperature)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., V] with V >= 1, got shape {tuple(logits.shape)}")
    check_label_tensor(labels, logits, "logits")
    compute_dtype(logits.dtype)
    lead, v = logits.shape[:-1], logits.shape[-1]
    rank, world = group_rank_size(group)
    _check_labels(labels, v * world, ignore_index)
    flat = logits.reshape(-1, v)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    backend = _dispatch.select_backend(flat, backend)
    flat_labels = labels.reshape(-1).long().contiguous()  # kernels index with int64, stride 1
    logp, entropy = _LogProbEntropy.apply(flat, flat_labels, inv_temp, int(ignore_index), group,
                                          backend)
    return logp.reshape(lead), entropy.reshape(lead)
