"""Where each Hugging Face tensor lives inside a vLLM model, and how to read it back (pure; no vLLM).

vLLM's `load_weights` takes full HF-named tensors and writes each into a parameter of one module,
sharded for this tensor-parallel rank and, for the stacked layers, into one part of a fused
parameter (`packed_modules_mapping`: `qkv_proj` holds q/k/v, `gate_up_proj` holds gate/up, for
the llama and qwen2 families). This module is the inverse, used by the weight verification
(`VLLMEngine.held_weights`): given every rank's local piece of a module's parameter (in rank
order, as an all-gather over the engine's TP group returns them), `assemble` rebuilds the full HF
tensor. `source_of` maps an HF name to (module, parameter, part), and `load_unit` names the
module, which is also the unit vLLM's layerwise reload processes: a sync must send every HF tensor
of a unit or none (`mrl.weights.delta.WeightSender` completes units in delta syncs).

Layouts (`Layout.kind`), per rank r of `tp`:
- `replicated`: every rank holds the whole tensor (norms, a row-parallel layer's bias);
- `column`: rows [r*n, (r+1)*n) (a plain column-parallel layer: weight and bias);
- `row`: columns [r*n, (r+1)*n) of the weight;
- `packed`: the local parameter is the concatenation along dim 0 of each part's local rows
  (`part_rows`, rows per rank of each part); part p's rows on rank r are rows
  [s*k, (s+1)*k) of the HF tensor, s = r // replicas[p] (k/v heads are replicated when the
  engine has more ranks than KV heads: `QKVParallelLinear.num_kv_head_replicas`);
- `vocab`: rows of the vocabulary padded to a multiple of the ranks; the first `rows` rows of
  the concatenation are the HF tensor (vLLM pads the vocabulary, `VocabParallelEmbedding`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

import torch

Kind = Literal["replicated", "column", "row", "packed", "vocab"]


@dataclass(frozen=True)
class Source:
    """An HF tensor's place in a vLLM model: `module`.`attr`, part `part` of a packed module."""

    module: str
    attr: str
    part: int | None = None


@dataclass(frozen=True)
class Layout:
    """How one parameter of a module is split over the engine's TP ranks (see the module doc)."""

    kind: Kind
    part_rows: tuple[int, ...] = ()    # packed: rows per rank of each part
    replicas: tuple[int, ...] = ()     # packed: ranks that hold the same rows of each part
    rows: int = 0                      # vocab: rows of the HF tensor (the unpadded vocabulary)


def source_of(hf_name: str, packed: Mapping[str, Sequence[str]]) -> Source:
    """`model.layers.0.self_attn.k_proj.weight` -> (`model.layers.0.self_attn.qkv_proj`, `weight`, 1)."""
    prefix, _, attr = hf_name.rpartition(".")
    parent, _, leaf = prefix.rpartition(".")
    for fused, parts in packed.items():
        if leaf in parts:
            return Source(f"{parent}.{fused}" if parent else fused, attr, list(parts).index(leaf))
    return Source(prefix, attr)


def load_unit(hf_name: str, packed: Mapping[str, Sequence[str]]) -> str:
    """The module an HF tensor loads into: every tensor of a unit arrives in the same sync or none."""
    return source_of(hf_name, packed).module


def assemble(layout: Layout, part: int | None, per_rank: Sequence[torch.Tensor]) -> torch.Tensor:
    """The full HF tensor from each rank's local parameter (rank order). `part`: which part of a
    packed parameter (None otherwise). The pieces are copied, never changed: a bit-exact inverse."""
    kind = layout.kind
    if kind == "replicated":
        return per_rank[0].clone()
    if kind == "column":
        return torch.cat(list(per_rank), 0)
    if kind == "row":
        return per_rank[0].clone() if per_rank[0].dim() == 1 else torch.cat(list(per_rank), 1)
    if kind == "vocab":
        return torch.cat(list(per_rank), 0)[:layout.rows].clone()
    if kind == "packed":
        if part is None:
            raise ValueError("a packed parameter is read back one part at a time")
        start = sum(layout.part_rows[:part])
        rows = layout.part_rows[part]
        replicas = layout.replicas[part] if layout.replicas else 1
        return torch.cat([t.narrow(0, start, rows) for r, t in enumerate(per_rank) if r % replicas == 0], 0)
    raise ValueError(f"unknown layout {kind!r}")
