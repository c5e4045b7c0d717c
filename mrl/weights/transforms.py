"""How one Megatron parameter relates to its Hugging Face tensor(s), in both directions.

A transform knows the layout of a Megatron parameter (full, and as tensor-parallel shards) and
of the HF tensors it comes from:
- `shard_from_hf`: read only the slices of the HF tensors that make this rank's TP shard;
- `to_hf`: turn the TP shards (gathered in rank order) back into full HF tensors;
- `hf_shapes`: the HF shapes implied by a full Megatron shape (checked on import, used to
  allocate receive buffers on export).
Transforms are stateless; model facts (query groups, true vocabulary size) come in `ModelDims`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class ModelDims:
    """The facts transforms need: query groups, heads per group, head dim, true vocabulary size;
    for Gated DeltaNet layers (`mrl.models.gated_deltanet`) `linear`: (key heads, value heads,
    key head dim, value head dim)."""

    num_query_groups: int
    heads_per_group: int
    head_dim: int
    vocab_size: int
    linear: Optional[tuple[int, int, int, int]] = None


class SliceReader:
    """Lazy access to one HF tensor: reads only the requested row or column range."""

    def __init__(self, name: str, handle, shape: Sequence[int]):
        self.name, self._handle, self.shape = name, handle, tuple(shape)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return self._handle[start:stop]

    def cols(self, start: int, stop: int) -> torch.Tensor:
        return self._handle[:, start:stop]

    def all(self) -> torch.Tensor:
        return self._handle[:]


def _chunk_range(size: int, rank: int, parts: int) -> tuple[int, int]:
    step = size // parts
    return rank * step, (rank + 1) * step


class Transform:
    """Identity: the Megatron tensor is the HF tensor, split along `partition_dim` under TP."""

    n_hf = 1

    def shard_from_hf(self, readers: list[SliceReader], tp_rank: int, tp_size: int,
                      partition_dim: Optional[int], full_shape: tuple[int, ...], dims: ModelDims) -> torch.Tensor:
        (r,) = readers
        if partition_dim is None or tp_size == 1:
            return r.all()
        a, b = _chunk_range(r.shape[partition_dim], tp_rank, tp_size)
        return r.rows(a, b) if partition_dim == 0 else r.cols(a, b)

    def to_hf(self, shards: list[torch.Tensor], partition_dim: Optional[int], dims: ModelDims) -> list[torch.Tensor]:
        if partition_dim is None or len(shards) == 1:
            return [shards[0]]
        return [torch.cat(shards, dim=partition_dim)]

    def hf_shapes(self, full_shape: tuple[int, ...], dims: ModelDims) -> list[tuple[int, ...]]:
        return [tuple(full_shape)]

    def __repr__(self) -> str:
        return type(self).__name__


class VocabRows(Transform):
    """Embedding / output layer: Megatron pads the vocabulary rows (zeros), HF does not."""

    def shard_from_hf(self, readers, tp_rank, tp_size, partition_dim, full_shape, dims):
        (r,) = readers
        padded = full_shape[0]
        a, b = _chunk_range(padded, tp_rank, tp_size)
        out = torch.zeros((b - a,) + tuple(r.shape[1:]), dtype=_dtype_of(r))
        real_b = min(b, dims.vocab_size)
        if real_b > a:
            out[: real_b - a] = r.rows(a, real_b)
        return out

    def to_hf(self, shards, partition_dim, dims):
        full = torch.cat(shards, dim=0) if len(shards) > 1 else shards[0]
        return [full[: dims.vocab_size]]

    def hf_shapes(self, full_shape, dims):
        return [(dims.vocab_size,) + tuple(full_shape[1:])]


def _dtype_of(reader: SliceReader) -> torch.dtype:
    return reader.rows(0, 0).dtype


class QKV(Transform):
    """Megatron's fused `linear_qkv` (weight or bias) <-> HF q_proj, k_proj, v_proj.

    Megatron interleaves by query group g: [q heads of g | k_g | v_g]; TP rank r holds the
    contiguous block of groups r*G/tp .. (r+1)*G/tp - 1, so each rank reads one row range of
    each of q, k and v.
    """

    n_hf = 3

    def shard_from_hf(self, readers, tp_rank, tp_size, partition_dim, full_shape, dims):
        q, k, v = readers
        g0, g1 = _chunk_range(dims.num_query_groups, tp_rank, tp_size)
        d, hpg = dims.head_dim, dims.heads_per_group
        qs = q.rows(g0 * hpg * d, g1 * hpg * d)
        ks, vs = k.rows(g0 * d, g1 * d), v.rows(g0 * d, g1 * d)
        tail = tuple(qs.shape[1:])
        groups = g1 - g0
        fused = torch.cat([qs.reshape(groups, hpg * d, *tail), ks.reshape(groups, d, *tail),
                           vs.reshape(groups, d, *tail)], dim=1)
        return fused.reshape(groups * (hpg + 2) * d, *tail)

    def to_hf(self, shards, partition_dim, dims):
        full = torch.cat(shards, dim=0) if len(shards) > 1 else shards[0]
        d, hpg, groups = dims.head_dim, dims.heads_per_group, dims.num_query_groups
        tail = tuple(full.shape[1:])
        per_group = full.reshape(groups, (hpg + 2) * d, *tail)
        q, k, v = per_group.split([hpg * d, d, d], dim=1)
        return [q.reshape(groups * hpg * d, *tail), k.reshape(groups * d, *tail), v.reshape(groups * d, *tail)]

    def hf_shapes(self, full_shape, dims):
        d, hpg, groups = dims.head_dim, dims.heads_per_group, dims.num_query_groups
        tail = tuple(full_shape[1:])
        return [(groups * hpg * d,) + tail, (groups * d,) + tail, (groups * d,) + tail]


class GateUp(Transform):
    """Megatron's SwiGLU `linear_fc1` = [gate; up] <-> HF gate_proj, up_proj.

    Under TP each rank holds [gate_r; up_r] (its slice of each half), not a row block of the
    full matrix.
    """

    n_hf = 2

    def shard_from_hf(self, readers, tp_rank, tp_size, partition_dim, full_shape, dims):
        gate, up = readers
        a, b = _chunk_range(gate.shape[0], tp_rank, tp_size)
        return torch.cat([gate.rows(a, b), up.rows(a, b)], dim=0)

    def to_hf(self, shards, partition_dim, dims):
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]

    def hf_shapes(self, full_shape, dims):
        half = (full_shape[0] // 2,) + tuple(full_shape[1:])
        return [half, half]


class InterleavedGateUp(Transform):
    """Megatron's `linear_fc1` [gate; up] (weight `[2I, H]` or bias `[2I]`) <-> gpt-oss' one expert
    `gate_up_proj` `[H, 2I]` (or its bias `[2I]`): gate and up interleaved along the last axis
    (`gate_up[..., ::2]`, `gate_up[..., 1::2]`), the weight stored input-major. Under TP each rank
    holds its slice of each half, as `GateUp`."""

    def shard_from_hf(self, readers, tp_rank, tp_size, partition_dim, full_shape, dims):
        (r,) = readers
        t = r.all()
        t = t.transpose(0, 1) if t.dim() == 2 else t                      # [2I, ...] interleaved
        gate, up = t[0::2], t[1::2]
        a, b = _chunk_range(gate.shape[0], tp_rank, tp_size)
        return torch.cat([gate[a:b], up[a:b]], dim=0)

    def to_hf(self, shards, partition_dim, dims):
        halves = [s.chunk(2, dim=0) for s in shards]
        gate = torch.cat([h[0] for h in halves], dim=0)
        up = torch.cat([h[1] for h in halves], dim=0)
        inter = torch.stack((gate, up), dim=1).reshape(2 * gate.shape[0], *gate.shape[1:])
        return [inter.transpose(0, 1) if inter.dim() == 2 else inter]

    def hf_shapes(self, full_shape, dims):
        return [tuple(reversed(full_shape))]


class Transposed(Transform):
    """A Megatron weight `[out, in]` <-> an HF tensor stored `[in, out]` (gpt-oss' expert `down_proj`);
    TP splits the Megatron dimension `partition_dim`, the other HF dimension."""

    def shard_from_hf(self, readers, tp_rank, tp_size, partition_dim, full_shape, dims):
        (r,) = readers
        if partition_dim is None or tp_size == 1:
            return r.all().transpose(0, 1)
        a, b = _chunk_range(r.shape[1 - partition_dim], tp_rank, tp_size)
        return (r.cols(a, b) if partition_dim == 0 else r.rows(a, b)).transpose(0, 1)

    def to_hf(self, shards, partition_dim, dims):
        full = torch.cat(shards, dim=partition_dim) if partition_dim is not None and len(shards) > 1 else shards[0]
        return [full.transpose(0, 1)]

    def hf_shapes(self, full_shape, dims):
        return [tuple(reversed(full_shape))]


class GatedQKV(Transform):
    """megatron's `linear_qkv` with the attention output gate (`attention_output_gate`) <-> HF
    q_proj (each head's query then its gate, `[H * 2d]` rows: Qwen3-Next's gated attention),
    k_proj, v_proj. megatron interleaves by query group g: [q heads of g | gate heads of g | k_g |
    v_g]; TP rank r holds a contiguous block of groups, as `QKV`."""

    n_hf = 3

    def shard_from_hf(self, readers, tp_rank, tp_size, partition_dim, full_shape, dims):
        q, k, v = readers
        g0, g1 = _chunk_range(dims.num_query_groups, tp_rank, tp_size)
        d, hpg = dims.head_dim, dims.heads_per_group
        qg = q.rows(g0 * hpg * 2 * d, g1 * hpg * 2 * d)
        tail = tuple(qg.shape[1:])
        groups = g1 - g0
        qg = qg.reshape(groups, hpg, 2, d, *tail)
        fused = torch.cat([qg[:, :, 0].reshape(groups, hpg * d, *tail), qg[:, :, 1].reshape(groups, hpg * d, *tail),
                           k.rows(g0 * d, g1 * d).reshape(groups, d, *tail),
                           v.rows(g0 * d, g1 * d).reshape(groups, d, *tail)], dim=1)
        return fused.reshape(groups * (2 * hpg + 2) * d, *tail)

    def to_hf(self, shards, partition_dim, dims):
        full = torch.cat(shards, dim=0) if len(shards) > 1 else shards[0]
        d, hpg, groups = dims.head_dim, dims.heads_per_group, dims.num_query_groups
        tail = tuple(full.shape[1:])
        q, gate, k, v = full.reshape(groups, (2 * hpg + 2) * d, *tail).split([hpg * d, hpg * d, d, d], dim=1)
        qg = torch.stack([q.reshape(groups, hpg, d, *tail), gate.reshape(groups, hpg, d, *tail)], dim=2)
        return [qg.reshape(groups * hpg * 2 * d, *tail), k.reshape(groups * d, *tail), v.reshape(groups * d, *tail)]

    def hf_shapes(self, full_shape, dims):
        d, hpg, groups = dims.head_dim, dims.heads_per_group, dims.num_query_groups
        tail = tuple(full_shape[1:])
        return [(groups * hpg * 2 * d,) + tail, (groups * d,) + tail, (groups * d,) + tail]


def _linear_sections(dims: ModelDims, parts: int) -> list[int]:
    """One TP rank's `in_proj` rows of a Gated DeltaNet (of `parts` ranks): q, k, v, z, b, a."""
    nk, nv, dk, dv = dims.linear
    kh, vh = nk // parts, nv // parts
    return [kh * dk, kh * dk, vh * dv, vh * dv, vh, vh]


class DeltaNetQKVZBA(Transform):
    """A Gated DeltaNet's `in_proj` (rows per TP rank [q_r k_r v_r z_r b_r a_r], megatron's
    GatedDeltaNet layout) <-> Qwen3-Next's `in_proj_qkvz` (per key head h: [q_h k_h v_h z_h], v/z of
    its `nv / nk` value heads) and `in_proj_ba` (per key head: [b a] of its value heads). TP rank r
    holds a contiguous block of key heads and their value heads."""

    n_hf = 2

    def shard_from_hf(self, readers, tp_rank, tp_size, partition_dim, full_shape, dims):
        qkvz, ba = readers
        nk, nv, dk, dv = dims.linear
        rep = nv // nk
        k0, k1 = _chunk_range(nk, tp_rank, tp_size)
        kh = k1 - k0
        block = 2 * dk + 2 * rep * dv
        rows = qkvz.rows(k0 * block, k1 * block)
        tail = tuple(rows.shape[1:])
        q, k, v, z = rows.reshape(kh, block, *tail).split([dk, dk, rep * dv, rep * dv], dim=1)
        b, a = ba.rows(k0 * 2 * rep, k1 * 2 * rep).reshape(kh, 2 * rep, *tail).split([rep, rep], dim=1)
        return torch.cat([x.reshape(-1, *tail) for x in (q, k, v, z, b, a)], dim=0)

    def to_hf(self, shards, partition_dim, dims):
        nk, nv, dk, dv = dims.linear
        rep, kh = nv // nk, nk // len(shards)
        qkvz, ba = [], []
        for shard in shards:
            tail = tuple(shard.shape[1:])
            q, k, v, z, b, a = (x.reshape(kh, -1, *tail) for x in shard.split(_linear_sections(dims, len(shards))))
            qkvz.append(torch.cat([q, k, v, z], dim=1).reshape(-1, *tail))
            ba.append(torch.cat([b, a], dim=1).reshape(-1, *tail))
        return [torch.cat(qkvz), torch.cat(ba)]

    def hf_shapes(self, full_shape, dims):
        nk, nv, dk, dv = dims.linear
        tail = tuple(full_shape[1:])
        return [(2 * nk * dk + 2 * nv * dv,) + tail, (2 * nv,) + tail]


class DeltaNetQKVZBASplit(Transform):
    """A Gated DeltaNet's `in_proj` (as `DeltaNetQKVZBA`) <-> Qwen3.5's `in_proj_qkv` ([all q | all k |
    all v] heads, the conv's channel order), `in_proj_z`, `in_proj_b` and `in_proj_a`."""

    n_hf = 4

    def shard_from_hf(self, readers, tp_rank, tp_size, partition_dim, full_shape, dims):
        qkv, z, b, a = readers
        nk, nv, dk, dv = dims.linear
        parts = []
        for start, size in ((0, nk * dk), (nk * dk, nk * dk), (2 * nk * dk, nv * dv)):
            lo, hi = _chunk_range(size, tp_rank, tp_size)
            parts.append(qkv.rows(start + lo, start + hi))
        for r in (z, b, a):
            lo, hi = _chunk_range(r.shape[0], tp_rank, tp_size)
            parts.append(r.rows(lo, hi))
        return torch.cat(parts, dim=0)

    def to_hf(self, shards, partition_dim, dims):
        pieces = [s.split(_linear_sections(dims, len(shards))) for s in shards]
        q, k, v, z, b, a = (torch.cat([p[i] for p in pieces]) for i in range(6))
        return [torch.cat([q, k, v]), z, b, a]

    def hf_shapes(self, full_shape, dims):
        nk, nv, dk, dv = dims.linear
        tail = tuple(full_shape[1:])
        return [(2 * nk * dk + nv * dv,) + tail, (nv * dv,) + tail, (nv,) + tail, (nv,) + tail]


class DeltaNetConv(Transform):
    """A Gated DeltaNet's depthwise `conv1d.weight` `[C, 1, K]`: HF channels [all q | all k | all v];
    TP rank r holds [q_r k_r v_r] (its key heads' and value heads' channels)."""

    def shard_from_hf(self, readers, tp_rank, tp_size, partition_dim, full_shape, dims):
        (r,) = readers
        nk, nv, dk, dv = dims.linear
        parts = []
        for start, size in ((0, nk * dk), (nk * dk, nk * dk), (2 * nk * dk, nv * dv)):
            lo, hi = _chunk_range(size, tp_rank, tp_size)
            parts.append(r.rows(start + lo, start + hi))
        return torch.cat(parts, dim=0)

    def to_hf(self, shards, partition_dim, dims):
        nk, nv, dk, dv = dims.linear
        tp = len(shards)
        pieces = [s.split([nk * dk // tp, nk * dk // tp, nv * dv // tp]) for s in shards]
        return [torch.cat([torch.cat([p[i] for p in pieces]) for i in range(3)])]


IDENTITY = Transform()
INTERLEAVED_GATE_UP = InterleavedGateUp()
TRANSPOSED = Transposed()
VOCAB = VocabRows()
QKV_FUSED = QKV()
GATE_UP = GateUp()
GATED_QKV = GatedQKV()
DELTANET_QKVZ_BA = DeltaNetQKVZBA()
DELTANET_QKV_Z_B_A = DeltaNetQKVZBASplit()
DELTANET_CONV = DeltaNetConv()
