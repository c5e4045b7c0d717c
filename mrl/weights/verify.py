"""Checksums of exported tensors: computed where the tensor lives (on the device when it has one),
compared as Python ints.

`checksum(t)` reads the tensor's bytes as 32-bit words (bytes when the size is not a multiple of
4) and returns (sum of words, position-weighted sum of words, byte count), each modulo 2**64. A
single changed byte changes the plain sum by a non-zero amount below 2**32, so it is always
caught; the weighted sum catches swapped words. It is a transfer check, not a cryptographic hash.
Work is chunked so the int64 temporaries stay small next to a multi-GiB tensor.
"""
from __future__ import annotations

import torch

Checksum = tuple[int, int, int]

_CHUNK_WORDS = 1 << 24
_MASK = (1 << 64) - 1
_WEIGHT_MOD = 65521   # position weights 1..65521 keep the products well inside int64 per word


def _words(t: torch.Tensor) -> torch.Tensor:
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.numel() % 4 == 0:
        try:
            return raw.view(torch.int32)
        except RuntimeError:   # a storage offset not aligned to 4 bytes
            pass
    return raw


def checksum(t: torch.Tensor) -> Checksum:
    """(sum, weighted sum, bytes) of `t`'s bytes; equal tensors (bit for bit) give equal checksums."""
    words = _words(t)
    total, weighted = 0, 0
    for start in range(0, words.numel(), _CHUNK_WORDS):
        chunk = words[start:start + _CHUNK_WORDS].to(torch.int64)
        pos = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=chunk.device) % _WEIGHT_MOD + 1
        total += int(chunk.sum())
        weighted += int((chunk * pos).sum())
    return total & _MASK, weighted & _MASK, t.numel() * t.element_size()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: do `a` and `b` (same shape and dtype) hold the same bytes? (NaNs and -0.0 by bits.)"""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.contiguous().view(ints) == b.contiguous().view(ints)


class WeightSyncError(RuntimeError):
    """A weight sync that did not arrive intact: one line naming the tensor, version and engine group."""
