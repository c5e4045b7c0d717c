"""The DeepSeek-V3 mixture of experts as megatron router fields, shared by deepseek_v3 (and
Kimi-K2, read as it) and glm4_moe (GLM-4.5), whose routers `transformers` computes alike.

Sigmoid scores; top-k chosen on scores plus the checkpoint's `e_score_correction_bias`
(megatron's expert bias, kept fixed: `moe_router_bias_update_rate` 0, RL does not re-balance)
within the `topk_group` best of `n_group` groups (a group's score is the sum of its top 2);
weights renormalised and scaled by `routed_scaling_factor`; shared experts of
`n_shared_experts x moe_intermediate_size`; the first `first_k_dense_replace` layers dense.
"""
from __future__ import annotations

from typing import Any

from mrl.errors import UserError


def sigmoid_moe_fields(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """TransformerConfig MoE fields for `hf` (an `arch` config), or one-line refusals of what
    megatron's router would compute differently from `transformers`."""
    if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise UserError(f"model.path: {arch} routing scoring_func {hf.get('scoring_func')!r} / topk_method "
                        f"{hf.get('topk_method')!r} is not supported (sigmoid / noaux_tc, as transformers' {arch})")
    if (hf.get("moe_layer_freq") or 1) != 1:
        raise UserError(f"model.path: {arch} with moe_layer_freq {hf['moe_layer_freq']} is not supported (experts in "
                        f"every layer from first_k_dense_replace on, as transformers' {arch})")
    if not hf.get("norm_topk_prob", True):
        raise UserError(f"model.path: {arch} with norm_topk_prob = false is not supported (megatron "
                        "renormalises sigmoid top-k weights)")
    experts = hf.get("n_routed_experts")
    if not experts:
        return {}
    topk, groups, group_topk = hf["num_experts_per_tok"], hf.get("n_group") or 1, hf.get("topk_group") or 1
    if groups > 1 and topk != 2 * group_topk:
        raise UserError(f"model.path: {arch} group-limited routing needs num_experts_per_tok = 2 x topk_group "
                        f"(a group scores its top 2 experts; megatron scores top num_experts_per_tok / topk_group), "
                        f"got {topk} and {group_topk}")
    dense = hf.get("first_k_dense_replace") or 0
    fields: dict[str, Any] = dict(
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_layer_freq=[0 if i < dense else 1 for i in range(hf["num_hidden_layers"])],
        moe_router_score_function="sigmoid",
        moe_router_pre_softmax=False,
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=group_topk if groups > 1 else None,
        moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        moe_router_load_balancing_type="none",
        moe_router_dtype="fp32",   # transformers' router scores in float32 whatever the model dtype
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
    )
    if hf.get("n_shared_experts"):
        fields.update(moe_shared_expert_intermediate_size=hf["n_shared_experts"] * hf["moe_intermediate_size"])
    return fields
