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


def checksum_update(before: Checksum, old: torch.Tensor, new: torch.Tensor, changed: torch.Tensor) -> Checksum:
    """`checksum(new)` from `before = checksum(old)` (same shape and dtype), where only the flat
    elements `changed` (indices) differ: both sums are linear in the words, so only the words
    holding a changed element are read (a delta sync's sparse tensors, without rehashing them)."""
    old_w, new_w = _words(old), _words(new)
    per_word, size = old_w.element_size(), old.element_size()
    idx = changed.reshape(-1).to(torch.int64)
    if size >= per_word:   # each element spans size / per_word whole words
        span = size // per_word
        words = (idx[:, None] * span + torch.arange(span, dtype=torch.int64)).reshape(-1)
    else:                  # several elements share a word
        words = torch.unique(idx * size // per_word)
    diff = new_w[words].to(torch.int64) - old_w[words].to(torch.int64)
    pos = words % _WEIGHT_MOD + 1
    return ((before[0] + int(diff.sum())) & _MASK, (before[1] + int((diff * pos).sum())) & _MASK, before[2])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: do `a` and `b` (same shape and dtype) hold the same bytes? (NaNs and -0.0 by bits.)"""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.contiguous().view(ints) == b.contiguous().view(ints)


class WeightSyncError(RuntimeError):
    """A weight sync that did not arrive intact: one line naming the tensor, version and engine group."""
