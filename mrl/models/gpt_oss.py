"""gpt-oss (`gpt_oss`) as megatron TransformerConfig fields.

What `transformers`' GptOss computes, and the megatron piece that computes the same:

- attention sinks: one learned logit per head in each softmax denominator (`self_attn.sinks`),
  megatron's `softmax_type = "learnable"` (its `core_attention.softmax_offset`; mrl's packed
  attention holds it as Transformer Engine does, `mrl.models.sink_attention` computes it);
- biases on q/k/v/o, the router and the experts (`add_bias_linear`);
- the clamped SwiGLU of `GptOssExperts`: `gate.clamp(max=limit)`, `up.clamp(-limit, limit)`,
  `(up + 1) * gate * sigmoid(alpha * gate)`: megatron's `quick_gelu` (alpha 1.702 fixed) with
  `glu_linear_offset` 1 and `activation_func_clamp_value` = `swiglu_limit`;
- the router: top-k over the biased logits, softmax over the k (`moe_router_pre_softmax` off);
- sliding-window layers where `layer_types` says `sliding_attention` (`window_size` with the
  per-layer `window_attn_skip_freq` list): a token sees itself and the `sliding_window - 1`
  before it, as transformers' sliding mask;
- yarn RoPE with its attention factor (`models.megatron.rope_attention_factor`).

The checkpoint stacks each layer's experts in one tensor per projection, MXFP4-packed in the
published checkpoints (`mrl.weights.stacked` reads both).
"""
from __future__ import annotations

from typing import Any

from mrl.errors import UserError

#: megatron's quick_gelu is x * sigmoid(1.702 x): the only `swiglu_alpha` it computes
SWIGLU_ALPHA = 1.702


def sliding_window_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """`window_size` and the per-layer `window_attn_skip_freq` list (1 = sliding) for a config
    whose `layer_types` mix `sliding_attention` and `full_attention` layers; none when no layer
    slides."""
    types = hf.get("layer_types") or []
    window = hf.get("sliding_window")
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise UserError(f"model.path: layer_types {unknown} are not supported (sliding_attention, full_attention)")
    if len(types) != hf["num_hidden_layers"]:
        raise UserError(f"model.path: layer_types has {len(types)} entries for {hf['num_hidden_layers']} layers")
    if not window or "sliding_attention" not in types:
        return {}
    return dict(window_size=(int(window) - 1, 0),
                window_attn_skip_freq=[int(t == "sliding_attention") for t in types])


def check_context_parallel(hf: dict[str, Any], context: int) -> None:
    """Sliding windows and attention sinks are computed on whole sequences: mrl's context-
    parallel attention (`models.context_parallel`) has neither."""
    if context > 1:
        raise UserError(f"parallel.context: {context} does not take {hf['model_type']}'s sliding-window layers or "
                        "attention sinks (mrl's context-parallel attention has neither); use parallel.context = 1")


def check_expert_bias(expert_tensor: int) -> None:
    """megatron-core builds experts with biases (gpt-oss) unsplit only."""
    if expert_tensor != 1:
        raise UserError(f"parallel.expert_tensor: {expert_tensor}: gpt_oss's expert biases need expert_tensor = 1 "
                        "(megatron-core splits biased experts over no tensor-parallel ranks); set "
                        "parallel.expert_tensor = 1 with parallel.tensor > 1")


def gpt_oss_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """TransformerConfig fields for a gpt_oss config, or one-line refusals of what megatron would
    compute differently."""
    from megatron.core.activations import quick_gelu

    if float(hf.get("swiglu_alpha", SWIGLU_ALPHA)) != SWIGLU_ALPHA:
        raise UserError(f"model.path: gpt_oss swiglu_alpha {hf['swiglu_alpha']} is not supported (megatron's "
                        f"quick_gelu computes {SWIGLU_ALPHA})")
    if not hf.get("attention_bias", True):
        raise UserError("model.path: gpt_oss with attention_bias = false is not supported (mrl builds the o_proj "
                        "and expert biases together)")
    fields: dict[str, Any] = dict(
        add_bias_linear=True,
        add_qkv_bias=True,
        activation_func=quick_gelu,
        glu_linear_offset=1.0,
        activation_func_clamp_value=float(hf.get("swiglu_limit", 7.0)),
        softmax_type="learnable",
        num_moe_experts=hf["num_local_experts"],
        moe_router_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["intermediate_size"],
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,   # top-k over logits, softmax over the k
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss" if hf.get("router_aux_loss_coef") else "none",
        moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef") or 0.0),
        moe_permute_fusion=False,
    )
    fields.update(sliding_window_fields(hf))
    return fields
