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
