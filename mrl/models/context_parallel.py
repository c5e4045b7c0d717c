"""Context parallelism (CP) for packed rows: load-balanced chunking, K/V all-gather, local attention.

Layout. With `parallel.context = N`, every sequence of a packed row is padded at its end to a
multiple of 2N tokens and cut into 2N equal chunks; CP rank r holds chunk r (from the front)
and chunk 2N-1-r (from the back). Causal attention costs a query chunk in proportion to its
index, so every rank does the same work: (r + 1) + (2N - r) = 2N + 1 chunk-units. A rank's
local row is, sequence after sequence, its front chunk then its back chunk (`CPLayout`). The
padding at the end of a sequence comes after its real tokens, so causality keeps it out of
their attention.

Attention: the torchtitan / Llama-3 form. Every layer all-gathers K and V over the CP group
(`gather_rows`: the backward reduces the K/V gradients back over the group), rebuilds each
sequence's K/V in order, and each local query chunk j attends to the keys `[0, (j+1) C)` of its
own sequence (causal within its own chunk). Chosen over ring attention because (1) it is exact
with one collective per layer (ring needs 2(N-1) point-to-point steps, each a log-sum-exp merge,
and their overlap with compute, to be efficient), (2) its cost is one gathered K/V per layer,
which with GQA (8x fewer KV heads than query heads in Qwen3/Llama) is small next to the
activations, and (3) packed rows of uneven sequences need no per-step bookkeeping: each rank
has the whole of every sequence's K/V. It also works on gloo (CPU) and NCCL alike, with no
Transformer Engine.

Kernels (no `[T, T]` or `[C, L]` score matrix is built):

- CPU (`sdpa`): the query chunk j against the keys of the earlier chunks (no mask) and against
  its own chunk (causal) are two calls of torch's CPU flash kernel in float32, merged by their
  log-sum-exps and rounded once (`mrl.models.flash_cpu`, the kernel CP1's `sdpa` runs too); the
  backward calls the flash backward of each block with the merged output and log-sum-exp
  (ring attention's backward). K/V are gathered in their own dtype and upcast, so their
  gradients from every chunk and CP rank are summed in float32 and rounded once: bf16 CP2
  then rounds as bf16 CP1 does (up to float32 order: one ulp in 0.02% of the outputs).
- CUDA (`varlen`): torch's packed flash attention with each query chunk as its own "sequence"
  and the prefix of its keys as the matching key "sequence" (flash's causal mask with fewer
  queries than keys is bottom-right aligned, which is exactly this). The key prefixes are cut
  from the float32 rows and cast for the kernel, so K/V gradients sum over chunks and ranks in
  float32 here too (the backward's reduce-scatter moves float32: twice the bytes of the K/V; the
  cut prefixes are float32 until the cast), but each chunk's dK/dV leave the bf16-only flash
  kernel rounded, a rounding one whole-sequence call does not have (the GPU tier bounds their
  error at 1.5x CP1's; output and dq round as CP1's). The bookkeeping is tested on CPU with a stand-in kernel
  (tests/engine/test_context_parallel.py), the kernel itself in the GPU tier (tests/gpu).

Per-token outputs (log-probs, entropy, values) are computed on the rank's own tokens and
all-gathered over the CP group (`gather_tokens`) so every CP rank holds the whole micro-batch's
values: every loss, aggregation and sequence-level ratio then runs unchanged, with whole-batch
token counts, redundantly on each CP rank. Its backward keeps a rank's own slice of the gradient
(each rank's copy of the loss is the same function), and the engine scales the loss by N to
undo megatron's gradient average over the data x context group.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Optional, Sequence

import torch

__all__ = ["CPLayout", "layout", "padded_length", "tokens_per_rank", "gather_rows", "gather_tokens", "attention"]


def padded_length(length: int, cp: int) -> int:
    """`length` rounded up to a multiple of 2 * cp (the 2N chunks of one sequence); `length`
    itself without context parallelism (cp = 1)."""
    if cp == 1:
        return int(length)
    unit = 2 * cp
    return -(-int(length) // unit) * unit


def tokens_per_rank(length: int, cp: int) -> int:
    """Tokens one CP rank holds of a sequence of `length`: two chunks of its 2N (the whole
    sequence at cp = 1)."""
    return padded_length(length, cp) // cp


@dataclasses.dataclass
class CPLayout:
    """Where this CP rank's tokens sit in the whole (padded) packed row.

    `lengths` are the sequences' padded lengths (multiples of 2 * size); `index[k]` is the row
    position of local token k, `positions[k]` its position in its own sequence (RoPE);
    `inverse` rebuilds the whole row from the ranks' local rows concatenated in rank order."""

    size: int
    rank: int
    group: Any
    lengths: list[int]
    index: torch.Tensor       # [T / size] int64
    positions: torch.Tensor   # [T / size] int64
    inverse: torch.Tensor     # [T] int64
    _cache: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def local_tokens(self) -> int:
        return int(self.index.numel())

    @property
    def row_tokens(self) -> int:
        return sum(self.lengths)

    def to(self, device) -> "CPLayout":
        return dataclasses.replace(self, index=self.index.to(device), positions=self.positions.to(device),
                                   inverse=self.inverse.to(device), _cache={})


def rank_index(lengths: Sequence[int], size: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row positions and in-sequence positions `([T / size], [T / size])` of CP rank `rank`'s
    tokens: per sequence its chunk `rank` then its chunk `2 * size - 1 - rank`."""
    idx, pos = [], []
    start = 0
    for length in lengths:
        if length % (2 * size):
            raise ValueError(f"sequence of {length} tokens is not padded to a multiple of 2 x {size}")
        c = length // (2 * size)
        for j in (rank, 2 * size - 1 - rank):
            idx.append(torch.arange(start + j * c, start + (j + 1) * c))
            pos.append(torch.arange(j * c, (j + 1) * c))
        start += length
    if not idx:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    return torch.cat(idx), torch.cat(pos)


def layout(lengths: Sequence[int], size: int, rank: int, group=None) -> CPLayout:
    """The `CPLayout` of CP rank `rank` for a row of sequences of padded `lengths`."""
    lengths = [int(x) for x in lengths]
    index, positions = rank_index(lengths, size, rank)
    everyone = torch.cat([rank_index(lengths, size, r)[0] for r in range(size)])
    inverse = torch.empty_like(everyone)
    inverse[everyone] = torch.arange(everyone.numel())
    return CPLayout(size=size, rank=rank, group=group, lengths=lengths, index=index, positions=positions,
                    inverse=inverse)


# --------------------------------------------------------------------------------- collectives

def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """`[size * n, ...]`: the ranks' `x` `[n, ...]` concatenated in rank order."""
    size = torch.distributed.get_world_size(group)
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    torch.distributed.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0 whose backward sums the gradient over the group (every rank's
    output reads every rank's input: K and V in attention). `dtype`: the output's (the gather
    moves `x`'s own bytes); the gradient is summed in it and rounded to `x`'s dtype once."""

    @staticmethod
    def forward(ctx, x, group, dtype=None):
        ctx.group, ctx.dtype = group, x.dtype
        out = _all_gather(x, group)
        return out if dtype is None else out.to(dtype)

    @staticmethod
    def backward(ctx, grad):
        size = torch.distributed.get_world_size(ctx.group)
        rank = torch.distributed.get_rank(ctx.group)
        grad = grad.contiguous()
        if torch.distributed.get_backend(ctx.group) == "nccl":
            out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
            torch.distributed.reduce_scatter_tensor(out, grad, group=ctx.group)
            return out.to(ctx.dtype), None, None
        torch.distributed.all_reduce(grad, group=ctx.group)   # gloo has no reduce-scatter of tensors
        return grad.chunk(size)[rank].to(ctx.dtype).contiguous(), None, None


class _GatherTokens(_GatherRows):
    """`_GatherRows`' all-gather whose backward keeps this rank's own slice: for values every rank
    feeds into the same (replicated) loss, so each rank's copy of the gradient is already whole."""

    @staticmethod
    def backward(ctx, grad):
        size = torch.distributed.get_world_size(ctx.group)
        return grad.chunk(size)[torch.distributed.get_rank(ctx.group)].to(ctx.dtype).contiguous(), None, None


def gather_rows(x: torch.Tensor, cp: CPLayout, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The whole row `[T, ...]` of a per-token tensor `x` `[T / size, ...]` (K or V), in row order;
    in `dtype` if given (its gradient is then summed over chunks and ranks in `dtype`)."""
    return _GatherRows.apply(x, cp.group, dtype).index_select(0, cp.inverse)


def gather_tokens(x: torch.Tensor, counts: Sequence[int], order: torch.Tensor, group) -> torch.Tensor:
    """Per-response-token values of every CP rank, `[sum(counts), ...]` in `order`: rank r holds
    `counts[r]` of them (`x` is this rank's); `order[k]` is the gathered position of value k. The
    ranks' counts differ, so each pads to the largest."""
    most = max(counts)
    if most == 0:   # no response token on any rank (every rank knows the same counts)
        return x[:0]
    pad = x.new_zeros((most - x.shape[0], *x.shape[1:]))
    gathered = _GatherTokens.apply(torch.cat([x, pad]), group, None)
    return gathered.index_select(0, order)


def token_order(counts: Sequence[int], ranks_index: Sequence[torch.Tensor], total: int) -> torch.Tensor:
    """`order` for `gather_tokens`: `ranks_index[r]` are the (global) response-token numbers rank r
    holds, in its local order; the result maps each global number to its slot in the padded
    gather."""
    most = max(counts) if counts else 0
    order = torch.empty(total, dtype=torch.long)
    for r, idx in enumerate(ranks_index):
        order[idx] = torch.arange(len(idx)) + r * most
    return order


# --------------------------------------------------------------------------------- attention

def _heads(x: torch.Tensor, rep: int) -> torch.Tensor:
    """`[L, H, D]` -> `[1, H * rep, L, D]` (K/V heads repeated per query group)."""
    if rep > 1:
        x = x.repeat_interleave(rep, dim=1)
    return x.transpose(0, 1).unsqueeze(0)


def _sdpa_cp(q, k_row, v_row, cp: CPLayout, scale: float) -> torch.Tensor:
    from mrl.models.flash_cpu import block_causal

    outs = []
    q_parts = torch.split(q, [2 * (n // (2 * cp.size)) for n in cp.lengths])
    for qs, ks, vs, n in zip(q_parts, torch.split(k_row, cp.lengths), torch.split(v_row, cp.lengths), cp.lengths):
        c = n // (2 * cp.size)
        if c == 0:
            continue
        for half, j in zip(torch.split(qs, c), (cp.rank, 2 * cp.size - 1 - cp.rank)):
            end = (j + 1) * c
            outs.append(block_causal(half, ks[:end], vs[:end], scale))
    if not outs:
        return q
    return torch.cat(outs)


def _varlen_cp(q, k_row, v_row, cp: CPLayout, scale: float) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    key = ("varlen", str(q.device))
    if key not in cp._cache:
        q_len, k_len, k_idx = [], [], []
        start = 0
        for n in cp.lengths:
            c = n // (2 * cp.size)
            for j in (cp.rank, 2 * cp.size - 1 - cp.rank):
                if c:
                    q_len.append(c)
                    k_len.append((j + 1) * c)
                    k_idx.append(torch.arange(start, start + (j + 1) * c))
            start += n
        cu = lambda ls: torch.tensor([0] + ls, dtype=torch.int32).cumsum(0).to(torch.int32).to(q.device)
        cp._cache[key] = (cu(q_len), cu(k_len), torch.cat(k_idx).to(q.device), max(q_len), max(k_len))
    cu_q, cu_k, k_idx, max_q, max_k = cp._cache[key]
    # cut from the rows in their dtype (float32 from `attention`) and cast for the kernel: a key's
    # gradients from its query chunks are summed in float32 (those of a KV group's query heads
    # inside the kernel with `enable_gqa`, else in float32 by `repeat_interleave`'s backward)
    k, v = k_row.index_select(0, k_idx), v_row.index_select(0, k_idx)
    kwargs = dict(scale=scale, window_size=(-1, 0))
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in inspect.signature(varlen_attn).parameters:
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return varlen_attn(q, k.to(q.dtype), v.to(q.dtype), cu_q, cu_k, max_q, max_k, **kwargs)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPLayout, scale: float,
              backend: str = "sdpa") -> torch.Tensor:
    """Causal attention of this CP rank's queries `[T / N, Hq, D]` over the whole sequences:
    K/V `[T / N, Hkv, D]` are all-gathered over the CP group, then each local query chunk
    attends to its sequence's keys up to the end of the chunk. Returns `[T / N, Hq, D]`."""
    # K/V travel in their dtype and are upcast: the K/V gradients of every query chunk and CP rank
    # are summed in float32 and rounded once, as one whole-sequence call rounds them
    k_row, v_row = gather_rows(k, cp, torch.float32), gather_rows(v, cp, torch.float32)
    if backend == "varlen":
        return _varlen_cp(q, k_row, v_row, cp, scale)
    if q.device.type != "cpu":
        raise ValueError(f"context-parallel attention with backend {backend!r} runs on CPU only; use 'varlen' on CUDA")
    return _sdpa_cp(q, k_row, v_row, cp, scale)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int],
                        scale: float) -> torch.Tensor:
    """Causal attention of each sequence of a whole row `[T, H, D]` with a dense mask (tests)."""
    outs = []
    rep = q.shape[1] // k.shape[1]
    for qs, ks, vs in zip(*(torch.split(x, list(lengths)) for x in (q, k, v))):
        o = torch.nn.functional.scaled_dot_product_attention(_heads(qs, 1), _heads(ks, rep), _heads(vs, rep),
                                                             is_causal=True, scale=scale)
        outs.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(outs)


def of(packed_seq_params: Any) -> Optional[CPLayout]:
    """The `CPLayout` a packed micro-batch carries on its `PackedSeqParams` (None without CP)."""
    return getattr(packed_seq_params, "mrl_cp", None) if packed_seq_params is not None else None
