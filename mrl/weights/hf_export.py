"""Export: this rank's Megatron shards -> a stream of full, Hugging Face-named tensors.

Tensors come out one at a time in checkpoint order (embedding, layers, final norm, head), each
gathered over tensor parallelism, gathered from its expert-parallel owner and broadcast from
its pipeline stage, then cast to the export dtype. `hf_buckets` packs the stream into
size-bounded buckets for engines that load in batches; peak extra memory is one bucket plus
the tensor being gathered.

`targets="all"`: every rank receives every tensor (colocated rollout engines, which shard
again by themselves). `targets=0`: only global rank 0 materialises full tensors (checkpoint
merge); the others only send their pieces, and replicas other than the first do nothing.

LoRA actors (`mrl.models.lora`) export merged weights, `W + (alpha / r) B A`, computed per TP
shard as each tensor is streamed: the rollout engine gets a plain model through the same names
and transforms as full fine-tuning. Chosen over vLLM's LoRA adapter loading because it works the
same for every engine (`hf`, vLLM with any parallelism, merge), adds no per-token adapter kernels
to generation (vLLM's punica path caps the rank and costs throughput), and keeps the rollout
log-probs those of exactly the weights the trainer holds. The cost is streaming the full model
each sync, as full fine-tuning does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Literal, Optional, Union

import torch
import torch.distributed as dist

from mrl.models.lora import merged_weight
from mrl.weights.layout import Placement, is_tied, local_placements, model_dims

Targets = Union[Literal["all"], int]


@dataclass(frozen=True)
class PlanEntry:
    """One Megatron parameter of the whole model, as every rank sees it."""

    order: tuple[int, int, int]
    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype      # export dtype
    expert: bool
    pp_owner: int           # pipeline stage that holds it
    ep_owner: int           # expert-parallel rank that holds it (0 for dense parameters)
    holder: int             # global rank that assembles it under `targets=<rank>`


def _ps():
    from megatron.core import parallel_state as ps

    return ps


def _replica_zero(expert: bool) -> bool:
    """True on the ranks whose copy is the one sent under `targets=<rank>`."""
    ps = _ps()
    if expert:
        return ps.get_expert_data_parallel_rank() == 0
    return ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0


def _plan(placements: list[Placement], dims, tied: bool, dtype: Optional[torch.dtype]) -> list[PlanEntry]:
    """The whole model's export plan, identical on every rank (one object all-gather)."""
    ps = _ps()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    mine = []
    for p in placements:
        if tied and p.rule.megatron == "output_layer.weight" and p.hf_names == ("lm_head.weight",):
            continue  # a tied head is the embedding; HF checkpoints of tied models omit it
        expert = p.expert is not None
        group_ranks = dist.get_process_group_ranks(p.tp_group) if dist.is_initialized() else [0]
        holder = group_ranks[0] if _replica_zero(expert) and dist.get_rank() == group_ranks[0] else -1
        mine.append(PlanEntry(order=p.order, hf_names=p.hf_names,
                              hf_shapes=tuple(p.transform.hf_shapes(p.full_shape, dims)),
                              dtype=dtype or p.param.dtype, expert=expert,
                              pp_owner=pp_rank, ep_owner=ep_rank if expert else 0, holder=holder))
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    merged: dict[tuple, PlanEntry] = {}
    for entries in everyone:
        for e in entries:
            key = (e.order, e.hf_names)
            if key not in merged or (merged[key].holder < 0 <= e.holder):
                merged[key] = e
    return sorted(merged.values(), key=lambda e: e.order)


class Exporter:
    """Streams one model's weights as HF tensors; the plan is computed once and reused."""

    def __init__(self, chunks: Iterable[torch.nn.Module], hf: dict[str, Any], *, dtype: Optional[torch.dtype] = None,
                 adapters: bool = False, quantize: Optional[Callable[[Iterable], Iterator]] = None):
        """`adapters`: stream the LoRA adapters themselves (PEFT's per-projection `lora_A` / `lora_B`,
        gathered over TP and PP like any weight) instead of the (merged) model weights.
        `quantize`: a transform of the stream (`mrl.weights.fp8.Fp8Stream` for FP8 rollout)."""
        self.chunks = list(chunks)
        self.hf = hf
        self.dims = model_dims(hf)
        self.placements = local_placements(self.chunks, hf, adapters=adapters)
        self.by_key = {(p.order, p.hf_names): p for p in self.placements}
        self.dtype = dtype
        self.quantize = quantize
        self.plan = _plan(self.placements, self.dims, is_tied(self.chunks), dtype)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.stream()

    def stream(self, targets: Targets = "all") -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, full tensor) pairs; empty on ranks that `targets` does not include.
        With `quantize`, what it makes of them (block-FP8 weights followed by their scales)."""
        return self.quantize(self._full(targets)) if self.quantize is not None else self._full(targets)

    def _full(self, targets: Targets) -> Iterator[tuple[str, torch.Tensor]]:
        with torch.no_grad():
            for entry in self.plan:
                tensors = (self._to_all(entry) if targets == "all" else self._to_rank(entry, int(targets)))
                if tensors is not None:
                    yield from zip(entry.hf_names, tensors)

    # -- every rank receives -------------------------------------------------------------
    def _to_all(self, e: PlanEntry) -> list[torch.Tensor]:
        ps = _ps()
        p = self.by_key.get((e.order, e.hf_names))
        on_stage = ps.get_pipeline_model_parallel_rank() == e.pp_owner
        tensors = None
        if on_stage and p is not None:
            tensors = self._assemble(p, gather_to=None)
        if on_stage and e.expert and ps.get_expert_model_parallel_world_size() > 1:
            tensors = self._broadcast(tensors, e, ps.get_expert_model_parallel_group(), e.ep_owner)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            tensors = self._broadcast(tensors, e, ps.get_pipeline_model_parallel_group(), e.pp_owner)
        return tensors

    # -- only `dst` receives ---------------------------------------------------------------
    def _to_rank(self, e: PlanEntry, dst: int) -> Optional[list[torch.Tensor]]:
        rank = dist.get_rank() if dist.is_initialized() else 0
        p = self.by_key.get((e.order, e.hf_names))
        tensors = None
        if p is not None and _replica_zero(e.expert):
            tensors = self._assemble(p, gather_to=e.holder)   # full only on the holder
        if e.holder == dst or not dist.is_initialized():
            return tensors if rank == dst else None
        if rank == e.holder:
            for t in tensors:
                dist.send(t.contiguous(), dst)
            return None
        if rank == dst:
            out = [torch.empty(s, dtype=e.dtype) for s in e.hf_shapes]
            for t in out:
                dist.recv(t, e.holder)
            return out
        return None

    # -- helpers ---------------------------------------------------------------------------
    def _assemble(self, p: Placement, gather_to: Optional[int]) -> Optional[list[torch.Tensor]]:
        """Full HF tensors from the TP shards: on every TP rank (`gather_to=None`) or on one."""
        dtype = self.dtype or p.param.dtype
        # W + scale * B A under LoRA adapters (this shard only, one at a time), else the weight
        shard = merged_weight(p.param).to(dtype).contiguous()  # cast first: fewer bytes to gather and split
        if p.tp_size > 1:
            if gather_to is None:
                shards = [torch.empty_like(shard) for _ in range(p.tp_size)]
                dist.all_gather(shards, shard, group=p.tp_group)
            else:
                me = dist.get_rank() == gather_to
                shards = [torch.empty_like(shard) for _ in range(p.tp_size)] if me else None
                dist.gather(shard, shards, dst=gather_to, group=p.tp_group)
                if not me:
                    return None
        else:
            shards = [shard]
        return [t.contiguous() for t in p.transform.to_hf(shards, p.partition_dim, self.dims)]

    def _broadcast(self, tensors, e: PlanEntry, group, src_index: int) -> list[torch.Tensor]:
        src = dist.get_process_group_ranks(group)[src_index]
        if tensors is None:
            tensors = [torch.empty(s, dtype=e.dtype) for s in e.hf_shapes]
        for t in tensors:
            dist.broadcast(t, src=src, group=group)
        return tensors


def hf_buckets(stream: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a weight stream into lists of at most `bucket_bytes` (a larger tensor goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in stream:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def export_hf_weights(chunks: Iterable[torch.nn.Module], hf: dict[str, Any], *, dtype: Optional[torch.dtype] = None, targets: Targets = "all") -> Iterator[tuple[str, torch.Tensor]]:
    """One-shot export stream; build an `Exporter` to reuse the plan across steps."""
    return Exporter(chunks, hf, dtype=dtype).stream(targets)
