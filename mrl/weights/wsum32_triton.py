"""The wsum32 checksum's CUDA kernel (`mrl.weights.verify`; imported lazily, needs Triton).

Each program reads one block of 32-bit words once and writes two int32 partial sums: the words,
and the words times their 1-based position. int32 arithmetic wraps, which is exactly the
modulo-2**32 sum the checksum is defined as, so no word is ever widened to int64. The position
is computed in int64 and truncated, (i + 1) modulo 2**32, so tensors beyond 2**31 words work.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _wsum32_kernel(words_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    w = tl.load(words_ptr + offs, mask=offs < n, other=0)
    pos = (offs + 1).to(tl.int32)
    tl.store(out_ptr + 2 * pid, tl.sum(w, axis=0))
    tl.store(out_ptr + 2 * pid + 1, tl.sum(w * pos, axis=0))


def wsum32_partials(words: torch.Tensor, block: int) -> torch.Tensor:
    """[programs, 2] int32 (sum, weighted sum) of each `block`-word block of flat int32 `words`."""
    programs = -(-words.numel() // block)
    partial = torch.empty(programs, 2, dtype=torch.int32, device=words.device)
    _wsum32_kernel[(programs,)](words, partial, words.numel(), BLOCK=block)
    return partial


@triton.jit
def _wsum32_many_kernel(base_ptr, table_ptr, out_ptr, BLOCK: tl.constexpr):
    # one block of one tensor per program: (word offset from base, position of its first word in
    # its tensor, words in the block, tensor index); the tensors are addressed from one base
    pid = tl.program_id(0)
    start = tl.load(table_ptr + 4 * pid)
    first = tl.load(table_ptr + 4 * pid + 1)
    count = tl.load(table_ptr + 4 * pid + 2)
    offs = tl.arange(0, BLOCK)
    w = tl.load(base_ptr + start + offs, mask=offs < count, other=0)
    pos = (first + offs + 1).to(tl.int32)
    tl.store(out_ptr + 2 * pid, tl.sum(w, axis=0))
    tl.store(out_ptr + 2 * pid + 1, tl.sum(w * pos, axis=0))


def wsum32_many_partials(base: torch.Tensor, table: torch.Tensor, block: int) -> torch.Tensor:
    """[blocks, 2] int32 (sum, weighted sum) of every block that `table` ([blocks, 4] int64 on
    `base`'s device, `mrl.weights.verify.block_table`) names, in one launch; the words of block b
    are base's words at `table[b, 0]` onwards (the other tensors' addresses taken from `base`'s)."""
    partial = torch.empty(table.shape[0], 2, dtype=torch.int32, device=base.device)
    if table.shape[0]:
        _wsum32_many_kernel[(table.shape[0],)](base, table, partial, BLOCK=block)
    return partial
