"""Fused LM head -> log-prob/entropy: `logits = hidden @ weight.T` is never materialised.

The token x vocabulary plane is walked in tiles of `chunk_tokens x chunk_vocab`. For each tile
the logits are computed by one matmul (in the input dtype, as the eager LM head would), reduced
to per-row statistics (m, s, t, zl) by the log-prob kernel (Triton on CUDA, twin on CPU) and
merged into a running [4, N] fp32 buffer; only that buffer and one tile are alive at a time.
With a TP group, `weight` is this rank's vocabulary slice and the per-rank statistics are
combined exactly as in `logprob_entropy` (all-reduce MAX, then one SUM).

The backward pass recomputes each tile's logits, turns them into the logits gradient in place
(same tile buffer) and projects it: grad_hidden += g @ W_tile and grad_W_tile += g.T @ h_tile,
accumulated in fp32. Vocabulary chunks are the outer loop, so the fp32 weight-gradient
accumulator is one [chunk_vocab, H] block; grad_hidden ([N, H] fp32) lives across the loop and
is all-reduced over the group at the end (hidden is replicated across TP ranks, as after
Megatron's copy-to-tensor-parallel-region, so every rank receives the full gradient).

Peak temporary memory is therefore about N*H*4 + chunk_vocab*H*(4 + elem) + 2 tiles, against
several fp32 [N, V] tensors for the eager path.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from mrl_kernels import _dispatch
from mrl_kernels.logprob import (
    IGNORE_INDEX, _check_labels, backward_grad, check_label_tensor, check_temperature, combine_group, combine_partials,
    compute_dtype, finalize, group_rank_size, twin_stats,
)

# Default tile: up to this many vocabulary columns, and as many tokens as keep the tile at
# about TILE_ELEMENTS (CUDA: 32M elements = 64 MiB bf16; CPU: 1M elements).
CHUNK_VOCAB = 16384
TILE_ELEMENTS_CUDA = 1 << 25
TILE_ELEMENTS_CPU = 1 << 20


def tile_shape(n: int, v: int, device: torch.device, chunk_tokens: int | None = None,
               chunk_vocab: int | None = None) -> tuple[int, int]:
    """(chunk_tokens, chunk_vocab) actually used for `n` tokens and a `v`-wide vocabulary slice."""
    cv = max(1, min(v, chunk_vocab or CHUNK_VOCAB))
    budget = TILE_ELEMENTS_CUDA if device.type == "cuda" else TILE_ELEMENTS_CPU
    ct = max(1, min(n, chunk_tokens or max(1, budget // cv)))
    return ct, cv


def _tiles(n: int, v: int, ct: int, cv: int):
    """Vocabulary chunks outer, token chunks inner (the backward pass relies on this order)."""
    for v0 in range(0, v, cv):
        for n0 in range(0, n, ct):
            yield v0, min(v, v0 + cv), n0, min(n, n0 + ct)


def _accumulate_tile(backend, running, logits, labels, vocab_start, inv_temp, ignore_index):
    if backend == "triton":
        _dispatch.triton_module("logprob_triton").accumulate_stats(
            running, logits, labels, vocab_start, inv_temp, ignore_index)
    else:
        part = twin_stats(logits, labels, vocab_start, inv_temp, ignore_index)
        running.copy_(combine_partials(torch.stack([running, part], dim=-1)))


def _accumulate_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, with acc in the accumulation dtype (fp32, or fp64 for the twin)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc += a @ b


class _LinearLogProbEntropy(torch.autograd.Function):
    """Saves hidden, weight (by reference), labels and fp32 lse/mu per row."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, inv_temp, ignore_index, group, backend, ct, cv):
        n, v = hidden.shape[0], weight.shape[0]
        rank, _ = group_rank_size(group)
        vocab_start = rank * v
        running = torch.zeros(4, n, dtype=compute_dtype(hidden.dtype), device=hidden.device)
        running[0] = float("-inf")
        for v0, v1, n0, n1 in _tiles(n, v, ct, cv):
            logits = hidden[n0:n1] @ weight[v0:v1].T
            _accumulate_tile(backend, running[:, n0:n1], logits, labels[n0:n1], vocab_start + v0,
                             inv_temp, ignore_index)
            del logits
        logp, entropy, lse, mu = finalize(combine_group(running, group), labels, ignore_index).unbind(0)
        ctx.save_for_backward(hidden, weight, labels, lse, mu)
        ctx.args = (vocab_start, inv_temp, ignore_index, group, backend, ct, cv)
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, labels, lse, mu = ctx.saved_tensors
        vocab_start, inv_temp, ignore_index, group, backend, ct, cv = ctx.args
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_w):
            return (None,) * 9
        n, v = hidden.shape[0], weight.shape[0]
        acc_dtype = compute_dtype(hidden.dtype)
        grad_logp, grad_entropy = grad_logp.contiguous(), grad_entropy.contiguous()
        grad_h = torch.zeros(hidden.shape, dtype=acc_dtype, device=hidden.device) if need_h else None
        # Every row block of grad_w is written below, unless there are no tokens at all.
        grad_w = (torch.empty_like(weight) if n else torch.zeros_like(weight)) if need_w else None
        grad_w_chunk = None
        for v0, v1, n0, n1 in _tiles(n, v, ct, cv):
            w, h = weight[v0:v1], hidden[n0:n1]
            if need_w and n0 == 0:
                grad_w_chunk = torch.zeros(w.shape, dtype=acc_dtype, device=w.device)
            logits = h @ w.T
            g = backward_grad(backend, logits, labels[n0:n1], vocab_start + v0, inv_temp,
                              ignore_index, lse[n0:n1], mu[n0:n1], grad_logp[n0:n1],
                              grad_entropy[n0:n1], out=logits)  # in place: no second tile
            # fp32 accumulation: in place when the inputs are fp32, else via a tile-sized product.
            if need_h:
                _accumulate_product(grad_h[n0:n1], g, w)
            if need_w:
                _accumulate_product(grad_w_chunk, g.T, h)
                if n1 == n:
                    grad_w[v0:v1] = grad_w_chunk
            del logits, g
        if need_h:
            if group_rank_size(group)[1] > 1:
                dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=group)  # contiguous fp32
            grad_h = grad_h.to(hidden.dtype)
        return grad_h, grad_w, None, None, None, None, None, None, None


def linear_logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                           temperature: float = 1.0, *, group=None,
                           ignore_index: int = IGNORE_INDEX, chunk_tokens: int | None = None,
                           chunk_vocab: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`logprob_entropy(hidden @ weight.T, labels, temperature, group=group)` without the logits.

    hidden: [..., H]; weight: [V, H] (with `group`: this rank's vocabulary slice [V/tp, H]), same
    dtype as hidden (bf16/fp16/fp32; fp64 for the twin); labels: [...] global ids or
    `ignore_index`. Returns (logp, entropy) [...] float32, differentiable w.r.t. hidden and
    weight. `chunk_tokens`/`chunk_vocab` override the tile (see `tile_shape`).
    """
    inv_temp = check_temperature(temperature)
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"need hidden [..., H] and weight [V, H]; got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("weight must have at least one vocabulary row")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    check_label_tensor(labels, hidden, "hidden")
    compute_dtype(hidden.dtype)
    _, world = group_rank_size(group)
    _check_labels(labels, weight.shape[0] * world, ignore_index)
    lead = hidden.shape[:-1]
    flat = hidden.reshape(-1, hidden.shape[-1])
    ct, cv = tile_shape(flat.shape[0], weight.shape[0], flat.device, chunk_tokens, chunk_vocab)
    backend = _dispatch.select_backend(flat)
    flat_labels = labels.reshape(-1).long().contiguous()  # kernels index with int64, stride 1
    logp, entropy = _LinearLogProbEntropy.apply(flat, weight, flat_labels, inv_temp,
                                                int(ignore_index), group, backend, ct, cv)
    return logp.reshape(lead), entropy.reshape(lead)
