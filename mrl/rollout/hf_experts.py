"""Per-expert checkpoint names -> views into `transformers`' fused expert tensors (the hf engine).

`transformers` 5 holds a MoE layer's experts as two 3-D parameters, `experts.gate_up_proj`
`[E, 2I, H]` (each expert's gate rows, then its up rows) and `experts.down_proj` `[E, H, I]`,
while checkpoints (and mrl's weight stream, `mrl/weights/tables.py`) name each expert's
projections apart: `experts.{E}.gate_proj.weight` (Mixtral: `block_sparse_moe.experts.{E}.w1`,
`w3`, `w2`, and its router `block_sparse_moe.gate`, which transformers 5 holds under `mlp.`). The hf
engine loads the stream through these views and aliases, so a sync writes straight into the fused
tensors. The renames are `transformers`' own checkpoint conversions (`conversion_mapping.py`).
gpt-oss keeps its checkpoint's stacked layout in memory (`gate_up_proj` `[E, H, 2I]`, interleaved,
with biases): the stream's `experts.{E}.<proj>` rows (`mrl.weights.stacked`) are row views of them.
"""
from __future__ import annotations

import torch

# per-expert HF names (gate, up, down) by checkpoint model_type; Qwen / DeepSeek names otherwise
_NAMES = {"mixtral": ("w1", "w3", "w2")}
# (in-memory module path piece, checkpoint's) pairs by model_type
_RENAMES = {"mixtral": ((".mlp.", ".block_sparse_moe."),),
            # Qwen2.5-VL: transformers 5 nests the language model and the tower; checkpoints do not
            "qwen2_5_vl": (("model.language_model.", "model."), ("model.visual.", "visual.")),
            # the multimodal Gemma 3: its checkpoints keep the LLaVA layout (transformers 5 writes it back)
            "gemma3": (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
                       ("model.multi_modal_projector.", "multi_modal_projector."))}


def checkpoint_name(name: str, model_type: str) -> str:
    """The checkpoint's name for the in-memory name `name` (the same for most architectures)."""
    for old, new in _RENAMES.get(model_type, ()):
        name = name.replace(old, new, 1)
    return name


def fused_expert_views(model: torch.nn.Module, model_type: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (view, the fused parameter it is part of), for every fused experts module of `model`."""
    gate, up, down = _NAMES.get(model_type, ("gate_proj", "up_proj", "down_proj"))
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for prefix, module in model.named_modules():
        gate_up = getattr(module, "gate_up_proj", None)
        down_w = getattr(module, "down_proj", None)
        if not (isinstance(gate_up, torch.nn.Parameter) and isinstance(down_w, torch.nn.Parameter)
                and gate_up.dim() == 3 and down_w.dim() == 3):
            continue
        if model_type == "gpt_oss":   # rows of the stacked tensors, as mrl.weights.stacked names them
            for p in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
                stacked = getattr(module, p)
                out.update({f"{checkpoint_name(prefix, model_type)}.{e}.{p}": (stacked.data[e], stacked)
                            for e in range(stacked.shape[0])})
            continue
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            stem = checkpoint_name(f"{prefix}.{e}", model_type)
            out[f"{stem}.{gate}.weight"] = (gate_up.data[e, :inter], gate_up)
            out[f"{stem}.{up}.weight"] = (gate_up.data[e, inter:], gate_up)
            out[f"{stem}.{down}.weight"] = (down_w.data[e], down_w)
    return out
