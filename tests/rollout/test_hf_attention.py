"""The HF engine's CPU attention in bf16 (mrl/rollout/hf_attention.py): transformers' SDPA in
float32, rounded once, on the language model only; nothing else changes."""
from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from mrl.rollout.hf_attention import NAME, float32_attention_on_cpu

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)


def _model(dtype, **over):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **{**TINY, **over}), dtype=dtype)


def _float64_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """The reference: attention in float64 with the same boolean mask, rounded once."""
    rep = query.shape[1] // key.shape[1]
    q, k, v = query.double(), key.double().repeat_interleave(rep, 1), value.double().repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    out = torch.nan_to_num(scores.softmax(-1)) @ v
    return out.transpose(1, 2).contiguous().to(query.dtype), None


def test_bf16_language_model_attention_computes_in_float32_and_rounds_once():
    """Same bf16 weights three ways, only the attention differs: the float32 switch lands nearer a
    float64 attention rounded once than transformers' bf16 SDPA does."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("float64_reference", _float64_attention)
    AttentionMaskInterface.register("float64_reference", sdpa_mask)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0   # left padding, as the engine batches prompts
    switched, plain, ref = _model(torch.bfloat16), _model(torch.bfloat16), _model(torch.bfloat16)
    ref.set_attn_implementation("float64_reference")
    assert float32_attention_on_cpu(switched) and switched.config._attn_implementation == NAME
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits.float()
        got = switched(ids, attention_mask=mask).logits.float()
        bf16 = plain(ids, attention_mask=mask).logits.float()
    keep = mask.bool()
    err_switched = (got - want)[keep].abs().mean().item()
    err_plain = (bf16 - want)[keep].abs().mean().item()
    assert err_switched < err_plain / 2, (err_switched, err_plain)


def test_float32_models_and_non_sdpa_attention_are_left_alone():
    fp32 = _model(torch.float32)
    assert not float32_attention_on_cpu(fp32) and fp32.config._attn_implementation == "sdpa"
    eager = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **TINY), dtype=torch.bfloat16,
                                             attn_implementation="eager")
    assert not float32_attention_on_cpu(eager) and eager.config._attn_implementation == "eager"


def test_a_vision_language_model_switches_its_text_model_only():
    from transformers import AutoModelForImageTextToText

    from mrl.models.facts import find_hf_config
    from mrl.models.vlm import hf_config_object

    model = AutoModelForImageTextToText.from_config(hf_config_object(find_hf_config("builtin:tiny-qwen2.5-vl")[0]),
                                                    dtype=torch.bfloat16)
    assert float32_attention_on_cpu(model)
    assert model.config.text_config._attn_implementation == NAME
    assert model.config.vision_config._attn_implementation == "sdpa"
