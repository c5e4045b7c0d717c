"""The output layer at chosen positions only: the hidden states a micro-batch needs go through it.

Every engine callback reads the model output at the response positions of a packed row
(`MicroBatch.take`): log-probs and entropy, a value head's values, SFT's trained tokens, DPO's
sequence log-probs, the teacher's logits for distillation. The LM head (`[T, H] @ [H, V/tp]`)
over the whole row spends most of its FLOPs on prompt tokens whose logits are then dropped;
for a small model with a large vocabulary (SmolLM2-135M: V 49152, H 576) that head is about a
fifth of the forward. `at_rows(model, positions)` selects the hidden states `[T, 1, H]` at
`positions` just before the output layer (a forward pre-hook on megatron's `output_layer`), so
the model returns `[1, N, V/tp]` (a value head `[1, N, 1]`) and nothing else changes:

- TP: the selection is on the rows of the replicated hidden states; the vocabulary-parallel
  output layer and its weight (tied to the embedding or not) are untouched.
- Sequence parallelism: the hidden states are sharded along the sequence there, so the hook
  all-gathers them first (as megatron's own inference path does for its last-token logits) and
  runs the layer without its sequence gather. The gradient stays a reduce-scatter: a
  `ColumnParallelLinear` all-reduces its input gradient once its sequence gather is off, so the
  gather's backward is a split; the value head (no TP communication of its own) keeps the
  reduce-scatter backward.
- PP: only the last stage has an output layer; the others pass through unchanged.
- CP: `positions` are this CP rank's local response positions (`MicroBatch.response_positions`);
  `take`/`gather` keep their meaning.
- LoRA, VLMs, MTP-free GPT models: the hook sits on whatever module is `output_layer`.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

__all__ = ["output_layer", "at_rows"]


def output_layer(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The output layer of a model chunk (inside DDP / Float16Module wrappers), None on a
    pipeline stage without one."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    layer = getattr(model, "output_layer", None)
    return layer if getattr(model, "post_process", True) else None


class _Rows:
    """The pre-hook of one output layer; `positions` is set for one forward call at a time."""

    def __init__(self, layer: torch.nn.Module):
        self.positions: Optional[torch.Tensor] = None
        self.restore_sp = False
        layer.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        if self.positions is None:
            return None
        hidden, rest = args[0], args[1:]
        positions, self.positions = self.positions, None   # once: the call this forward is for
        if getattr(module, "sequence_parallel", False):
            from megatron.core.tensor_parallel import ColumnParallelLinear, gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=not isinstance(module, ColumnParallelLinear))
            module.sequence_parallel = False
            self.restore_sp = True
        return (hidden.index_select(0, positions), *rest), kwargs


@contextlib.contextmanager
def at_rows(model: torch.nn.Module, positions: torch.Tensor):
    """Within the block, the next forward of `model` computes its output layer only at the row
    `positions` `[N]` (of a `[1, T]` packed row): the output is `[1, N, ...]`. A stage without an
    output layer is unaffected."""
    layer = output_layer(model)
    if layer is None:
        yield
        return
    hook = getattr(layer, "_mrl_rows", None)
    if hook is None:
        hook = _Rows(layer)
        layer._mrl_rows = hook
    hook.positions = positions
    try:
        yield
    finally:
        hook.positions = None
        if hook.restore_sp:
            layer.sequence_parallel, hook.restore_sp = True, False
