"""Checksums of exported tensors, each computed in one pass where the tensor lives.

A `Checksum` is (algorithm, digest, byte count) over the tensor's raw bytes:

- `"xxh3"` (host memory): xxHash's XXH3-128 of the bytes, read in place through a zero-copy
  view (up to about 40 GB/s on one core of the dev machine; 3-22 GB/s measured there under a
  load average of 6-18, `tools/bench/checksum.py`).
- `"wsum32"` (device memory): the position-weighted word sum of the bytes read as little-endian
  32-bit words w_0 .. w_{n-1} (zero-padded to a whole word): S = sum(w_i) and
  W = sum((i + 1) * w_i), both modulo 2**32, digest S + 2**32 * W. On CUDA one fused Triton
  kernel reads every word once and keeps int32 partial sums that wrap, so nothing is widened;
  elsewhere the same value comes from two int32 reductions of the words laid out as rows
  (S and W follow from the row and column sums, see `_wsum32_torch`).

What they catch: any change inside one 32-bit word changes S by a non-zero amount below 2**32,
so a flipped byte is always caught by wsum32; two swapped words i and j change W by
(w_i - w_j)(j - i), which is caught whenever that product is not a multiple of 2**32 (always
for neighbours). XXH3-128 catches both except with probability 2**-128. Neither is a
cryptographic hash: they check a transfer, not an adversary.

`checksum(t)` picks the algorithm of `t`'s device; `checksum(t, algorithm=...)` computes a
given one on any device, which is how a receiver checks a tensor against the sender's checksum
wherever either side's copy lives (`matches`). Several tensors are checksummed as one payload
(a sparse update's values and indices).

`checksum_many(payloads)` gives the checksums of many payloads at once (a bucket's, a
verification's): equal to `checksum` of each, but on CUDA every word of every payload is read by
one kernel launch over a table of blocks (each naming its tensor's address, its first word's
position and its length), the per-block partials are summed per tensor on the device and the
sums come back in one host read: one launch and one synchronisation per bucket instead of one
each per tensor (about 78 us apiece on an H100).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

Checksum = tuple[str, int, int]   # (algorithm, digest, bytes)

ALGORITHMS = ("xxh3", "wsum32")
_MASK32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1
_ROW_WORDS = 4096        # wsum32 without Triton: words per row of the (rows, _ROW_WORDS) layout
_BLOCK_WORDS = 8192      # wsum32 kernel: words per program


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor on its device (a view when it is contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def default_algorithm(t: torch.Tensor) -> str:
    """The checksum computed where `t` lives: xxh3 in host memory, wsum32 on a device."""
    return "xxh3" if t.device.type == "cpu" else "wsum32"


def checksum(*tensors: torch.Tensor, algorithm: Optional[str] = None) -> Checksum:
    """The checksum of the bytes of `tensors` (one payload); equal bytes give equal checksums.
    `algorithm`: one of `ALGORITHMS` (default: the first tensor's device's, `default_algorithm`)."""
    algorithm = algorithm or default_algorithm(tensors[0])
    raws = [_raw(t) for t in tensors]
    size = sum(r.numel() for r in raws)
    if algorithm == "xxh3":
        import xxhash

        h = xxhash.xxh3_128()
        for raw in raws:
            h.update(memoryview(raw.cpu().numpy()))
        return algorithm, h.intdigest(), size
    if algorithm == "wsum32":
        digest = 0
        for k, raw in enumerate(raws):   # parts folded in order, so values and indices cannot trade places
            digest = (digest + (2 * k + 1) * wsum32(raw)) & _MASK64
        return algorithm, digest, size
    raise ValueError(f"unknown checksum algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")


def checksum_many(payloads: Sequence[Sequence[torch.Tensor]], algorithm: Optional[str] = None) -> list[Checksum]:
    """`[checksum(*p, algorithm=algorithm) for p in payloads]`, batched: the wsum32 sums of all the
    payloads' CUDA tensors come from one kernel launch and one host read per device."""
    algos = [algorithm or default_algorithm(p[0]) for p in payloads]
    raws = [[_raw(t) for t in p] for p in payloads]
    parts = [(i, k, r) for i, (a, rs) in enumerate(zip(algos, raws)) if a == "wsum32"
             for k, r in enumerate(rs) if r.is_cuda and r.numel()]
    sums: dict[tuple[int, int], int] = {}
    if parts and _kernel_many() is not None:
        for device in {r.device for _, _, r in parts}:
            mine = [(i, k, r) for i, k, r in parts if r.device == device]
            for (i, k, _), s in zip(mine, _wsum32_many([r for _, _, r in mine])):
                sums[i, k] = s
    out = []
    for i, (a, rs) in enumerate(zip(algos, raws)):
        if a != "wsum32":
            out.append(checksum(*payloads[i], algorithm=a))
            continue
        digest = 0
        for k, raw in enumerate(rs):   # folded as `checksum` folds a payload's parts
            digest = (digest + (2 * k + 1) * (sums[i, k] if (i, k) in sums else wsum32(raw))) & _MASK64
        out.append((a, digest, sum(r.numel() for r in rs)))
    return out


def matches(expected: Checksum, *tensors: torch.Tensor) -> bool:
    """Do `tensors` hash to `expected` (computed with `expected`'s algorithm, on their device)?"""
    return checksum(*tensors, algorithm=expected[0]) == tuple(expected)


def first_mismatch(expected: Sequence[Optional[Checksum]], payloads: Sequence[Sequence[torch.Tensor]]) -> Optional[int]:
    """The index of the first payload that does not hash to its `expected` checksum (None: no
    checksum at all), or None when all match; computed with `checksum_many` per algorithm."""
    bad = [i for i, e in enumerate(expected) if e is None]
    for algorithm in {e[0] for e in expected if e is not None}:
        idx = [i for i, e in enumerate(expected) if e is not None and e[0] == algorithm]
        got = checksum_many([payloads[i] for i in idx], algorithm=algorithm)
        bad += [i for i, g in zip(idx, got) if g != tuple(expected[i])]
    return min(bad) if bad else None


def checksum_update(before: Checksum, old: torch.Tensor, new: torch.Tensor, changed: torch.Tensor) -> Checksum:
    """`checksum(new, algorithm=before[0])` from `before` (the checksum of `old`, same shape and
    dtype), where only the flat elements `changed` (indices) differ. wsum32 is linear in the
    words, so only the words holding a changed element are read (a delta sync's sparse tensors,
    without rehashing them); xxh3 is not, so it rehashes `new`."""
    if before[0] != "wsum32":
        return checksum(new, algorithm=before[0])
    old_w, new_w = _words(_raw(old)), _words(_raw(new))
    size = old.element_size()
    idx = changed.reshape(-1).to(torch.int64).to(old_w.device)
    if size >= 4:   # each element spans size / 4 whole words
        span = size // 4
        words = (idx[:, None] * span + torch.arange(span, dtype=torch.int64, device=idx.device)).reshape(-1)
    else:           # several elements share a word
        words = torch.unique(idx * size // 4)
    u64 = lambda x: x.cpu().numpy().view(np.uint32).astype(np.uint64)   # noqa: E731
    with np.errstate(over="ignore"):   # uint64 wraps modulo 2**64, a multiple of 2**32
        diff = u64(new_w[words]) - u64(old_w[words])
        pos = words.cpu().numpy().astype(np.uint64) + np.uint64(1)
        s = (before[1] & _MASK32) + int(diff.sum(dtype=np.uint64))
        w = (before[1] >> 32) + int((diff * pos).sum(dtype=np.uint64))
    return before[0], (s & _MASK32) | ((w & _MASK32) << 32), before[2]


# --------------------------------------------------------------------------------------- wsum32
def _words(raw: torch.Tensor) -> torch.Tensor:
    """`raw` (flat uint8) as int32 words, zero-padded to a whole word (copied only when padded or
    when its storage offset is not 4-byte aligned)."""
    pad = -raw.numel() % 4
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    try:
        return raw.view(torch.int32)
    except RuntimeError:   # a storage offset not aligned to 4 bytes
        return raw.clone().view(torch.int32)


def wsum32(raw: torch.Tensor) -> int:
    """S + 2**32 * W of flat uint8 `raw` (see the module doc): the Triton kernel on CUDA, else torch."""
    words = _words(raw)
    if words.numel() == 0:
        return 0
    if words.is_cuda and _kernel() is not None:
        s, w = _wsum32_triton(words)
    else:
        s, w = _wsum32_torch(words)
    return (s & _MASK32) | ((w & _MASK32) << 32)


def _wsum32_torch(words: torch.Tensor) -> tuple[int, int]:
    """(S, W) from two int32 reductions (wrapping, nothing widened): with the words as rows of C,
    word i = r*C + c, so W = C * sum_r r * rowsum_r + sum_c (c + 1) * colsum_c; the tail that
    fills no row is summed directly. The small vectors are combined as uint64 on the host."""
    n = words.numel()
    rows = n // _ROW_WORDS
    body = words[:rows * _ROW_WORDS].view(rows, _ROW_WORDS)
    u64 = lambda x: x.cpu().numpy().view(np.uint32).astype(np.uint64)   # noqa: E731
    row = u64(body.sum(1, dtype=torch.int32))
    col = u64(body.sum(0, dtype=torch.int32))
    tail = u64(words[rows * _ROW_WORDS:])
    r = np.arange(rows, dtype=np.uint64)
    c = np.arange(1, _ROW_WORDS + 1, dtype=np.uint64)
    t = np.arange(rows * _ROW_WORDS + 1, n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):   # uint64 arithmetic wraps modulo 2**64, a multiple of 2**32
        s = int(row.sum(dtype=np.uint64) + tail.sum(dtype=np.uint64))
        w = int(np.uint64(_ROW_WORDS) * (r * row).sum(dtype=np.uint64) + (c * col).sum(dtype=np.uint64)
                + (t * tail).sum(dtype=np.uint64))
    return s, w


def _kernel():
    """The Triton wsum32 launcher (`mrl.weights.wsum32_triton`), or None where Triton is not
    installed (imported on the first CUDA checksum only)."""
    try:
        from mrl.weights.wsum32_triton import wsum32_partials
    except ImportError:
        return None
    return wsum32_partials


def _kernel_many():
    """The batched Triton wsum32 launcher, or None without Triton."""
    try:
        from mrl.weights.wsum32_triton import wsum32_many_partials
    except ImportError:
        return None
    return wsum32_many_partials


def block_table(addresses: Sequence[int], lengths: Sequence[int], block: int) -> tuple[int, np.ndarray]:
    """The batched kernel's work list for tensors of int32 words at byte `addresses` with
    `lengths` words: (index of the base tensor, the one at the lowest address, and an int64
    [blocks, 4] table of (first word's offset from the base in words, its position in its tensor,
    words in the block, tensor index)), every tensor cut into `block`-word blocks, empty ones
    into none."""
    base = int(np.argmin(addresses))
    offsets = np.array([(a - addresses[base]) // 4 for a in addresses], dtype=np.int64)
    if any((a - addresses[base]) % 4 for a in addresses):
        raise ValueError("wsum32: tensors not 4-byte aligned to each other")
    lengths = np.asarray(lengths, dtype=np.int64)
    blocks = -(-lengths // block)
    tensor = np.repeat(np.arange(len(lengths), dtype=np.int64), blocks)
    first = (np.arange(len(tensor), dtype=np.int64) - np.repeat(np.cumsum(blocks) - blocks, blocks)) * block
    table = np.stack([offsets[tensor] + first, first, np.minimum(block, lengths[tensor] - first), tensor], axis=1)
    return base, table.reshape(-1, 4)


def _wsum32_many(raws: list[torch.Tensor], block: int = _BLOCK_WORDS) -> list[int]:
    """wsum32 of each flat uint8 tensor of `raws` (CUDA, one device; host tensors only under
    Triton's interpreter): one launch, one host read."""
    words = [_words(r) for r in raws]
    base, table = block_table([w.data_ptr() for w in words], [w.numel() for w in words], block)
    device = words[0].device
    table_dev = torch.from_numpy(table).to(device)
    partial = _kernel_many()(words[base], table_dev, block)
    per = torch.zeros(len(words), 2, dtype=torch.int64, device=device)
    per.index_add_(0, table_dev[:, 3], partial.to(torch.int64) & _MASK32)   # each below 2**32: no overflow
    return [(s & _MASK32) | ((w & _MASK32) << 32) for s, w in per.tolist()]


def _wsum32_triton(words: torch.Tensor) -> tuple[int, int]:
    """(S, W) from one kernel pass; the per-program partials (a few per MiB) are added on the device."""
    partial = _kernel()(words, _BLOCK_WORDS)
    s, w = (partial.to(torch.int64) & _MASK32).sum(0).tolist()
    return s, w


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: do `a` and `b` (same shape and dtype) hold the same bytes? (NaNs and -0.0 by bits.)"""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.contiguous().view(ints) == b.contiguous().view(ints)


class WeightSyncError(RuntimeError):
    """A weight sync that did not arrive intact: one line naming the tensor, version and engine group."""
