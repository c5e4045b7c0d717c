"""Where each of this rank's Megatron parameters sits in the Hugging Face checkpoint.

Matches local parameter names against a table, turns local layer/expert indices into global
ones (pipeline stage offset, expert-parallel rank), and records the tensor-parallel group that
shards the parameter (the expert-tensor group for experts).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterable, Optional

import torch

from mrl.errors import UserError
from mrl.weights.tables import BUFFER_SUFFIXES, LORA_ADAPTERS, Rule, is_adapter_name, table_for
from mrl.weights.transforms import ModelDims, Transform

_LAST = 10**9


def model_dims(hf: dict[str, Any]) -> ModelDims:
    heads = hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads") or heads
    linear = (tuple(int(hf[k]) for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                          "linear_value_head_dim")) if hf.get("linear_num_key_heads") else None)
    return ModelDims(num_query_groups=groups, heads_per_group=heads // groups,
                     head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, vocab_size=hf["vocab_size"],
                     linear=linear)


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk


@lru_cache(maxsize=None)
def _compiled(pattern: str) -> re.Pattern:
    rx = (re.escape(pattern).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
          .replace(r"\{R\}", r"(?P<R>.+)"))
    return re.compile(rx + r"\Z")


@dataclass
class Placement:
    """One local parameter and the HF tensors it maps to."""

    name: str                       # "<chunk index>/<megatron name>"
    param: torch.Tensor
    rule: Rule
    row: int                        # the rule's index in its table (orders tensors within a layer)
    hf_names: tuple[str, ...]
    layer: Optional[int]            # global layer index
    expert: Optional[int]           # global expert index
    partition_dim: Optional[int]    # TP split dimension, None = replicated
    tp_group: Any
    tp_size: int
    tp_rank: int

    @property
    def transform(self) -> Transform:
        return self.rule.transform

    @property
    def full_shape(self) -> tuple[int, ...]:
        shape = list(self.param.shape)
        if self.partition_dim is not None:
            shape[self.partition_dim] *= self.tp_size
        return tuple(shape)

    @property
    def order(self) -> tuple[int, int, int]:
        """Sort key giving HF order: embedding, layers (ascending, experts inside), final norm, head."""
        if self.layer is not None:
            return (self.layer, -1 if self.expert is None else self.expert, self.row)
        return (-1 if self.rule.megatron.startswith(("embedding", "vision")) else _LAST, 0, self.row)


def _groups(expert: bool, model: torch.nn.Module):
    """(group, size, rank) the parameter is split over: the model's own tensor-parallel group
    (megatron's `model.pg_collection.tp`: the job's, or a teacher's of its own layout), the job's
    expert tensor-parallel group for experts."""
    from megatron.core import parallel_state as ps

    if expert:
        return (ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_rank())
    own = getattr(getattr(model, "pg_collection", None), "tp", None)
    if own is not None:
        import torch.distributed as dist

        return own, dist.get_world_size(own), dist.get_rank(own)
    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def has_value_head(model: torch.nn.Module) -> bool:
    from mrl.models.roles import ValueHead

    return isinstance(getattr(model, "output_layer", None), ValueHead)


def local_placements(chunks: Iterable[torch.nn.Module], hf: dict[str, Any], *,
                     adapters: bool = False) -> list[Placement]:
    """Every parameter of this rank's model chunks, mapped through the architecture's table
    (with the value-head row when the model has one: critic, reward model); with `adapters`,
    only the LoRA adapters, mapped through `tables.LORA_ADAPTERS` to their PEFT names.

    A parameter no row matches is an error naming it: a table gap must never drop weights.
    """
    from megatron.core import parallel_state as ps

    ep_rank = ps.get_expert_model_parallel_rank()
    out: list[Placement] = []
    for c, chunk in enumerate(chunks):
        model = unwrap(chunk)
        rules = LORA_ADAPTERS if adapters else table_for(hf["model_type"], "critic" if has_value_head(model) else "actor")
        decoder = getattr(model, "decoder", None)
        layer_numbers = [layer.layer_number - 1 for layer in decoder.layers] if decoder is not None else []
        local_experts = _local_expert_count(model)
        for name, param in _mapped_tensors(model, adapters):
            if is_adapter_name(name) != adapters:   # LoRA adapters: exported merged into their base weight
                continue                                # or, with `adapters`, on their own
            row, m = _match(rules, name)
            if row is None:
                raise UserError(f"weights: parameter {name!r} of a {hf['model_type']} model has no row in its "
                                "weight-mapping table")
            rule = rules[row]
            layer = layer_numbers[int(m["L"])] if "L" in m else None
            expert = ep_rank * local_experts + int(m["E"]) if "E" in m else None
            fmt = {k: v for k, v in (("L", layer), ("E", expert), ("R", m.get("R"))) if v is not None}
            group, size, rank = _groups(expert is not None, model)
            tp_split = getattr(param, "tensor_model_parallel", False) and size > 1
            out.append(Placement(
                name=f"{c}/{name}", param=param, rule=rule, row=row,
                hf_names=tuple(n.format(**fmt) for n in rule.hf_names), layer=layer, expert=expert,
                partition_dim=getattr(param, "partition_dim", 0) if tp_split else None,
                tp_group=group, tp_size=size if tp_split else 1, tp_rank=rank if tp_split else 0))
    return out


def _mapped_tensors(model: torch.nn.Module, adapters: bool):
    """The parameters, then the buffers that checkpoints carry (`tables.BUFFER_SUFFIXES`: DeepSeek-V3's
    router correction bias), by name."""
    yield from model.named_parameters()
    if not adapters:
        yield from ((n, b) for n, b in model.named_buffers() if n.endswith(BUFFER_SUFFIXES))


def _match(rules: tuple[Rule, ...], name: str):
    for row, rule in enumerate(rules):
        m = _compiled(rule.megatron).match(name)
        if m:
            return row, m.groupdict()
    return None, {}


def _local_expert_count(model: torch.nn.Module) -> int:
    cfg = getattr(model, "config", None)
    experts = getattr(cfg, "num_moe_experts", None)
    if not experts:
        return 0
    from megatron.core import parallel_state as ps

    return experts // ps.get_expert_model_parallel_world_size()


def is_tied(chunks: Iterable[torch.nn.Module]) -> bool:
    return any(getattr(unwrap(c), "share_embeddings_and_output_weights", False) for c in chunks)
