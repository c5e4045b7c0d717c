"""Import: a Hugging Face safetensors checkpoint -> this rank's Megatron shards.

Each rank opens the checkpoint lazily and reads only the slices its shards need
(`safe_open(...).get_slice`); no rank loads the whole model. Every problem (missing or
unexpected tensors, shape mismatches) is found before any weight is copied, agreed on by all
ranks, and reported naming the tensor.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from mrl.errors import UserError
from mrl.weights import stacked as stacked_rows
from mrl.weights.layout import Placement, has_value_head, is_tied, local_placements, model_dims, unwrap
from mrl.weights.tables import LEGACY_PREFIXES
from mrl.weights.transforms import SliceReader

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Buffers some exporters write that carry no weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class Checkpoint:
    """A safetensors checkpoint directory (single file or sharded with an index), opened lazily.

    `file`: read only that file of the directory, its tensor names without `prefix` (a PEFT
    adapter directory: `adapter_model.safetensors`, names under `base_model.model.`)."""

    def __init__(self, path: str | Path, *, file: str | None = None, prefix: str = "",
                 renames: tuple[tuple[str, str], ...] = ()):
        from safetensors import safe_open

        self.path = Path(path)
        self.prefix = prefix
        index = self.path / INDEX
        if file is not None:
            if not (self.path / file).is_file():
                raise UserError(f"weights: {self.path} has no {file}")
            with safe_open(self.path / file, framework="pt") as f:
                # a name outside `prefix` keeps its full name: reported as unexpected, never read
                weight_map = {k[len(prefix):] if k.startswith(prefix) else k: file for k in f.keys()}
        elif index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.path / SINGLE).is_file():
            with safe_open(self.path / SINGLE, framework="pt") as f:
                weight_map = {k: SINGLE for k in f.keys()}
        else:
            raise UserError(f"weights: {self.path} has neither {INDEX} nor {SINGLE}")
        # `renames`: (stored prefix, table prefix) pairs, an older layout of the same tensors
        # (`tables.LEGACY_PREFIXES`): the tables' names, read under the stored ones
        self._stored = {_renamed(k, renames): k for k in weight_map} if renames else {}
        if self._stored:
            weight_map = {new: weight_map[old] for new, old in self._stored.items()}
        self.weight_map: dict[str, str] = weight_map
        self._open = safe_open
        self._handles: dict[str, Any] = {}
        # experts stacked per projection (gpt-oss, MXFP4 or not): read one expert's row at a time
        stacked = {n: tuple(self._slice(n).get_shape()) for n in weight_map if ".experts." in n
                   and n.endswith(stacked_rows.PROJECTIONS + ("_blocks", "_scales"))}
        self._rows = stacked_rows.expert_rows(stacked)
        self._row_sources = {s for sources in self._rows.values() for s in sources}
        self._stacked_shapes = stacked

    def __contains__(self, name: str) -> bool:
        return name in self._rows or (name in self.weight_map and name not in self._row_sources)

    def names(self) -> set[str]:
        return (set(self.weight_map) - self._row_sources) | set(self._rows)

    def _slice(self, name: str):
        file = self.weight_map[name]
        if file not in self._handles:
            path = self.path / file
            if not path.is_file():
                raise UserError(f"weights: {INDEX} names {file} for {name!r}, but {path} does not exist")
            self._handles[file] = self._open(path, framework="pt")
        return self._handles[file].get_slice(self.prefix + self._stored.get(name, name))

    def reader(self, name: str) -> SliceReader:
        sources = self._rows.get(name)
        if sources is not None:   # one expert's row of a stacked tensor (dequantized when MXFP4)
            row = stacked_rows.read_row(sources, [self._slice(s) for s in sources], stacked_rows.row_expert(name))
            return SliceReader(name, row, row.shape)
        sl = self._slice(name)
        return SliceReader(name, sl, sl.get_shape())

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape without reading it (a stacked row's from its stacked tensor)."""
        sources = self._rows.get(name)
        if sources is not None:
            return stacked_rows.row_shape(sources, self._stacked_shapes)
        return tuple(self._slice(name).get_shape())

    def close(self) -> None:
        self._handles.clear()


def _renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old):]
    return name


@dataclass
class ImportReport:
    tensors_read: int = 0
    bytes_read: int = 0
    initialised: list[str] = field(default_factory=list)   # parameters kept at init (critic value head)
    mtp_skipped: int = 0    # tensors of multi-token-prediction layers, not loaded


def mtp_tensors(names: Iterable[str], hf: dict[str, Any]) -> set[str]:
    """The checkpoint's multi-token-prediction layers (DeepSeek-V3's and GLM-4.5's
    `num_nextn_predict_layers`, stored as `model.layers.<num_hidden_layers + i>.*`): a speculative
    decoding head that `transformers` does not load and mrl does not train."""
    extra = int(hf.get("num_nextn_predict_layers") or 0)
    if not extra:
        return set()
    first = int(hf["num_hidden_layers"])
    layers = {f"model.layers.{i}." for i in range(first, first + extra)}
    return {n for n in names if n.startswith(tuple(layers))}


def _sources(p: Placement, ckpt: Checkpoint, tied: bool, hf: dict[str, Any]) -> tuple[str, ...]:
    if tied and p.rule.megatron == "output_layer.weight" and p.hf_names == ("lm_head.weight",) \
            and "lm_head.weight" not in ckpt:
        from mrl.weights.tables import embedding_name

        return (embedding_name(hf["model_type"]),)
    return p.hf_names


def load_hf_checkpoint(chunks: Iterable[torch.nn.Module], path: str | Path | Checkpoint, hf: dict[str, Any], *,
                       role: str = "actor", adapters: bool = False,
                       progress: Callable[[int, int], None] | None = None) -> ImportReport:
    """Copy the checkpoint at `path` into this rank's Megatron model `chunks` (in place).

    Models with a value head map it to `score.weight`. `role="critic"` may start from a policy
    checkpoint (the value head then keeps its initialisation); a reward model needs `score.weight`.
    `adapters`: only the LoRA adapters of `chunks`, from a `Checkpoint` of PEFT-named tensors
    (`mrl.models.lora_adapter`). `progress(done, total)` is called after each of this rank's
    parameters is copied. A collective over the world: every rank must call it.
    """
    chunks = list(chunks)
    renames = LEGACY_PREFIXES.get(hf.get("model_type"), ())   # (the multimodal Gemma 3's older layout)
    ckpt = path if isinstance(path, Checkpoint) else Checkpoint(path, renames=renames)
    path = ckpt.path
    dims = model_dims(hf)
    tied = is_tied(chunks)
    # A critic or reward model built from a policy checkpoint has no use for its LM head.
    lm_head_unused = not adapters and (tied or any(has_value_head(unwrap(c)) for c in chunks))
    placements = local_placements(chunks, hf, adapters=adapters)
    problems: list[str] = []
    consumed: set[str] = set()
    plan: list[tuple[Placement, tuple[str, ...]]] = []
    keep_init: list[str] = []
    for p in placements:
        names = _sources(p, ckpt, tied, hf)
        missing = [n for n in names if n not in ckpt]
        if missing and role == "critic" and p.rule.megatron == "output_layer.weight":
            keep_init.append(p.name)
            continue
        if missing:
            problems.append(f"missing tensor {missing[0]!r} (for {p.name.split('/', 1)[1]})")
            continue
        consumed.update(names)
        want = p.transform.hf_shapes(p.full_shape, dims)
        for n, shape in zip(names, want):
            got = ckpt.shape(n)
            if got != tuple(shape):
                problems.append(f"tensor {n!r} has shape {list(got)}, the model needs {list(shape)}")
        plan.append((p, names))

    # Agree on problems and on what the whole model consumes before touching any weight.
    from mrl.platform.collectives import gather_objects

    gathered = gather_objects((problems, consumed), "weight import check")
    problems = sorted({q for ps, _ in gathered for q in ps})
    consumed = set().union(*(c for _, c in gathered))
    mtp = mtp_tensors(ckpt.names() - consumed, hf)
    unexpected = sorted(n for n in ckpt.names() - consumed - mtp
                        if not n.endswith(_IGNORED_SUFFIXES) and not (lm_head_unused and n == "lm_head.weight"))
    problems += [f"unexpected tensor {n!r} (no parameter of this {hf['model_type']} model maps to it)"
                 for n in unexpected]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UserError(f"weights: {path}: {problems[0]}{more}")

    report = ImportReport(initialised=keep_init)
    with torch.no_grad():
        for done, (p, names) in enumerate(plan, 1):
            readers = [ckpt.reader(n) for n in names]
            shard = p.transform.shard_from_hf(readers, p.tp_rank, p.tp_size, p.partition_dim, p.full_shape, dims)
            if tuple(shard.shape) != tuple(p.param.shape):
                raise UserError(f"weights: {path}: {names[0]!r} gives a shard of shape {list(shard.shape)} for "
                                f"{p.name.split('/', 1)[1]} of shape {list(p.param.shape)}")
            p.param.data.copy_(shard.to(p.param.dtype))
            report.tensors_read += len(names)
            report.bytes_read += shard.numel() * shard.element_size()
            if progress is not None:
                progress(done, len(plan))
    ckpt.close()
    report.mtp_skipped = len(mtp)
    if mtp:
        log.info("weights: %s: %d tensor(s) of the %d multi-token-prediction layer(s) not loaded (mrl trains the "
                 "main model; transformers does not load them either)", path, len(mtp), hf["num_nextn_predict_layers"])
    if keep_init:
        log.info("weights: %s has no value head; %d parameter(s) keep their initialisation", path, len(keep_init))
    return report
