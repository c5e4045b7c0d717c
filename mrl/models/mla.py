"""DeepSeek-V3's multi-latent attention as megatron MLATransformerConfig fields, and the RoPE
parameters of a Hugging Face config (read by every architecture, `models.megatron`)."""
from __future__ import annotations

from typing import Any

from mrl.errors import UserError
from mrl.models.sigmoid_moe import sigmoid_moe_fields


def rope_parameters(hf: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE type and parameters, from transformers 5's `rope_parameters` or the older
    `rope_theta` / `rope_scaling` fields; per layer type where the config nests them (Gemma 3:
    `full_attention`, the default here, and `sliding_attention`)."""
    params = dict(hf.get("rope_parameters") or {})
    if "full_attention" in params:
        params = dict(params[layer_type or "full_attention"] or {})
    if not params:
        params = dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def deepseek_v3_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """MLATransformerConfig fields for DeepSeek-V3 / R1 (`hf` may carry `_tensor_parallel`, checked
    against the MLA down projections' rows).

    Multi-latent attention: q through a rank-`q_lora_rank` bottleneck with its RMSNorm (or one
    projection when `q_lora_rank` is null), k/v from a rank-`kv_lora_rank` latent plus one shared
    `qk_rope_head_dim` RoPE key; RoPE on the interleaved pairs (`rope_interleave`, megatron's MLA
    convention). MoE: `models.sigmoid_moe`. Kimi-K2 (`model_type = "kimi_k2"`, read as deepseek_v3: `facts.MODEL_TYPE_ALIASES`)
    is this architecture with one group (`n_group` 1); its remote code's routing fields must say
    what transformers computes (`scoring_func` sigmoid, `topk_method` noaux_tc, `moe_layer_freq` 1).
    Training-time balancing fields of that code (`aux_loss_alpha`, `seq_aux`) are not applied: the
    correction bias stays fixed and no auxiliary loss is added, as for deepseek_v3.
    """
    if not hf.get("rope_interleave", True):
        raise UserError("model.path: deepseek_v3 with rope_interleave = false is not supported (megatron's MLA "
                        "rotates interleaved pairs)")
    sigmoid_moe_fields(hf, "deepseek_v3")   # its refusals before the TP ones
    tp = int(hf.get("_tensor_parallel", 1))
    for name, rows in (("q_lora_rank", hf.get("q_lora_rank") or 0),
                       ("kv_lora_rank + qk_rope_head_dim", hf["kv_lora_rank"] + hf["qk_rope_head_dim"])):
        if rows % tp:
            raise UserError(f"parallel.tensor: {tp} does not divide deepseek_v3's {name} ({rows}), the rows of a "
                            "column-parallel MLA down projection")
    rope = rope_parameters(hf)
    fields: dict[str, Any] = dict(
        multi_latent_attention=True,
        qk_layernorm=True,   # the latent norms: Transformer Engine's spec fuses them into the up projections
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=hf["kv_lora_rank"],
        qk_head_dim=hf["qk_nope_head_dim"],
        qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        kv_channels=hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
        num_query_groups=hf["num_attention_heads"],
        rotary_base=float(rope["rope_theta"]),
        rotary_scaling_factor=1.0,
        mscale=1.0,
        mscale_all_dim=0.0,
    )
    if rope["rope_type"] == "default":
        fields.update(rope_type="rope")
    elif rope["rope_type"] == "yarn":
        fields.update(rope_type="yarn", rotary_scaling_factor=float(rope["factor"]),
                      original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                      beta_fast=float(rope.get("beta_fast") or 32.0), beta_slow=float(rope.get("beta_slow") or 1.0),
                      mscale=float(rope.get("mscale") or 1.0), mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0))
    else:
        raise UserError(f"model.path: RoPE type {rope['rope_type']!r} is not supported for deepseek_v3 "
                        "(default, yarn)")
    fields.update(sigmoid_moe_fields(hf, "deepseek_v3"))
    return fields
