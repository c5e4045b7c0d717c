"""The HF engine's attention on CPU in bf16 / fp16: transformers' SDPA computed in float32 and
rounded once, as the trainer's CPU attention computes it (`mrl.models.flash_cpu`).

Why: on CPU the trainer's `sdpa` backend runs torch's flash kernel in float32 and rounds its output
once (so bf16 rounds alike at every context-parallel size). Left at transformers' bf16 SDPA, the
engine rounds the softmax probabilities to bf16 inside the kernel, and the bf16 step-1 audit of
the quickstart (`rollout/logprob_abs_diff_max`) reads 4.0e-3 where the weights are the same.
With both sides in float32 inside, they differ only where float32 summation order flips a bf16
rounding. Only the language model's attention changes: a vision tower runs the same transformers
module on both sides and keeps its implementation. Models whose attention is not transformers'
SDPA (eager, e.g. gpt-oss' sinks) keep theirs; on GPUs nothing changes (the trainer's kernels
there are flash / TE in the model dtype)."""
from __future__ import annotations

import torch

NAME = "mrl_sdpa_float32"
_registered = False


def _float32_sdpa(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    mask = attention_mask if attention_mask is None or attention_mask.dtype == torch.bool else attention_mask.float()
    out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), mask, **kwargs)
    return out.to(query.dtype), weights


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(NAME, _float32_sdpa)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True


def float32_attention_on_cpu(model: torch.nn.Module) -> bool:
    """Switch `model`'s language-model attention to `NAME` when it runs transformers' SDPA in a
    16-bit dtype on CPU; returns whether it did."""
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype not in (torch.bfloat16, torch.float16):
        return False
    config = model.config
    text = getattr(config, "text_config", None)
    target = text if text is not None and getattr(config, "vision_config", None) is not None else config
    if getattr(target, "_attn_implementation", None) != "sdpa":
        return False
    _register()
    model.set_attn_implementation({"text_config": NAME} if target is not config else NAME)
    return True
