"""Checkpoints that stack a layer's experts in one tensor per projection (gpt-oss), and MXFP4.

gpt-oss checkpoints hold `model.layers.{L}.mlp.experts.gate_up_proj` `[E, H, 2I]` (and
`gate_up_proj_bias`, `down_proj`, `down_proj_bias`) for all experts of a layer; the published
ones hold the two weights MXFP4-packed instead (`<proj>_blocks` `[E, rows, G, 16]` uint8, two
FP4 values a byte, and `<proj>_scales` `[E, rows, G]`, one power of two per 32 values).
mrl's tables and weight stream name each expert's row apart, `experts.{E}.<proj>`, so that
expert parallelism, the weight sync and the hf engine's views handle one expert at a time:

- reading, `expert_rows` lists a checkpoint's stacked tensors as per-expert rows and
  `read_row` reads one (dequantizing MXFP4 with `transformers`' own
  `convert_moe_packed_tensors`; the values are exact in float32 and bfloat16);
- writing, `stack_experts` turns the stream's rows back into the stacked tensors (unquantized:
  mrl trains and writes the job's dtype).
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Iterator, Optional

import torch

PROJECTIONS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
#: the projections MXFP4 checkpoints pack (their biases are stored plain)
PACKED = ("gate_up_proj", "down_proj")
_STACKED = re.compile(r"(?P<stem>.+\.experts)\.(?P<proj>" + "|".join(PROJECTIONS) + r")(?P<q>_blocks|_scales)?\Z")
_ROW = re.compile(r"(?P<stem>.+\.experts)\.(?P<e>\d+)\.(?P<proj>" + "|".join(PROJECTIONS) + r")\Z")


def expert_rows(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, ...]]:
    """Per-expert row name -> the stacked checkpoint tensor(s) it is read from (one plain tensor,
    or MXFP4's blocks and scales), for every stacked expert tensor among `shapes` (name -> shape)."""
    rows: dict[str, tuple[str, ...]] = {}
    for name, shape in shapes.items():
        m = _STACKED.match(name)
        if m is None or m["q"] == "_scales":
            continue
        if m["q"] == "_blocks":
            if m["proj"] not in PACKED:
                continue
            sources: tuple[str, ...] = (name, f"{m['stem']}.{m['proj']}_scales")
        else:
            sources = (name,)
        for e in range(shape[0]):
            rows[f"{m['stem']}.{e}.{m['proj']}"] = sources
    return rows


def row_shape(sources: tuple[str, ...], shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The shape of one expert's row of `sources` (MXFP4: the dequantized `[G x 32, rows]`)."""
    shape = tuple(shapes[sources[0]])
    if len(sources) == 1:
        return shape[1:]
    _, rows, groups, block = shape
    return (groups * block * 2, rows)


def read_row(sources: tuple[str, ...], handles, expert: int) -> torch.Tensor:
    """Expert `expert`'s row of the stacked tensor (`handles`: safetensors slices of `sources`)."""
    if len(sources) == 1:
        return handles[0][expert:expert + 1][0]
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = (h[expert:expert + 1] for h in handles)
    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)[0]


def row_expert(name: str) -> Optional[int]:
    m = _ROW.match(name)
    return None if m is None else int(m["e"])


def stack_experts(stream: Iterable[tuple[str, torch.Tensor]], hf: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """The weight stream with each layer's per-expert rows (`experts.{E}.<proj>`) stacked back into
    the checkpoint's `experts.<proj>` `[E, ...]`, emitted once its `E` rows have passed (the stream
    gives a layer's experts together); other tensors pass through unchanged."""
    experts = int(hf.get("num_local_experts") or 0)
    held: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in stream:
        m = _ROW.match(name) if experts else None
        if m is None:
            yield name, tensor
            continue
        key = f"{m['stem']}.{m['proj']}"
        rows = held.setdefault(key, {})
        rows[int(m["e"])] = tensor
        if len(rows) == experts:
            yield key, torch.stack([rows[e] for e in range(experts)])
            del held[key]
    if held:
        key, rows = next(iter(held.items()))
        raise RuntimeError(f"weights: the stream gave {len(rows)} of {experts} expert rows of {key}")
