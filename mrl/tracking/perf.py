"""Throughput of a step from its reduced metrics: tokens per second for the rollout and the update.

Each rank reports what it processed (`tokens/rollout_response`: response tokens it generated in
every generation round of the step; `tokens/actor_update`: prompt + response tokens of its batch
times the actor's epochs). After the reduction those are means over data-parallel ranks and stage
times are maxima over all ranks, so the whole job's rate is `mean x dp / max time`.
"""
from __future__ import annotations

from typing import Mapping

from mrl.models.facts import HYBRID_TYPES, layer_kinds


def throughput(metrics: Mapping[str, float], dp: int) -> dict[str, float]:
    """`throughput/rollout_tokens_per_s` and `throughput/train_tokens_per_s` (the whole job's)."""
    out = {}
    # a separate rollout's generation time is the rollout side's own (time/rollout_generate)
    rollout_s = "time/rollout" if "time/rollout" in metrics else "time/rollout_generate"
    for name, tokens, seconds in (("rollout", "tokens/rollout_response", rollout_s),
                                  ("train", "tokens/actor_update", "time/actor_update")):
        if tokens in metrics and metrics.get(seconds, 0.0) > 0:
            out[f"throughput/{name}_tokens_per_s"] = metrics[tokens] * dp / metrics[seconds]
    return out


# Dense bf16 tensor-core peaks (FLOP/s) by device-name fragment; MFU is not reported elsewhere.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "B200": 2250e12}


def peak_bf16_flops(device_name: str) -> float | None:
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_name), None)


def model_params(hf: dict, *, active: bool = True) -> int:
    """Parameters of a decoder-only Hugging Face config (dense or MoE); `active` counts the experts
    one token passes through (`num_experts_per_tok`) instead of all of them. Covers shared experts
    (Qwen2-MoE with its gate, DeepSeek-V3, GLM-4.5), their dense first layers, DeepSeek's multi-latent
    attention, gpt-oss' biases and sinks and Gemma 3's sandwich norms."""
    h, layers, vocab = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
    model_type = hf.get("model_type")
    heads = hf["num_attention_heads"]
    if model_type == "deepseek_v3":
        attn = _mla_params(hf)
    else:
        kv = hf.get("num_key_value_heads") or heads
        d = hf.get("head_dim") or h // heads
        bias = bool(hf.get("attention_bias", model_type in ("qwen2", "gpt_oss"))
                    or (model_type == "qwen2_moe" and hf.get("qkv_bias", True)))
        attn = h * heads * d + 2 * h * kv * d + heads * d * h + (bias * (heads + 2 * kv) * d)
        if model_type in HYBRID_TYPES:   # gated attention: q_proj also emits each head's output gate
            attn += h * heads * d
        if (model_type in ("qwen3", "qwen3_moe", "gemma3_text", "gemma3") + HYBRID_TYPES
                or (model_type == "glm4_moe" and hf.get("use_qk_norm"))):
            attn += 2 * d   # q_norm, k_norm
        if model_type == "gpt_oss":
            attn += h + heads   # o_proj bias, one sink per head
    experts = hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts") or 0
    dense_mlp = 3 * h * (hf.get("intermediate_size") or 0)   # (Qwen3.5-MoE has no dense MLP)
    if experts:
        used = (hf.get("num_experts_per_tok") or experts) if active else experts
        inter = hf.get("moe_intermediate_size") or hf["intermediate_size"]
        moe = used * 3 * h * inter + h * experts   # experts + router
        if model_type == "gpt_oss":   # expert biases (gate/up, down) and the router's
            moe += used * (2 * inter + h) + experts
        if model_type in ("qwen2_moe",) + HYBRID_TYPES and hf.get("shared_expert_intermediate_size"):
            moe += 3 * h * hf["shared_expert_intermediate_size"] + h   # shared expert + its gate
        if model_type in ("deepseek_v3", "glm4_moe"):
            moe += 3 * h * inter * (hf.get("n_shared_experts") or 0)
        dense_layers = (hf.get("first_k_dense_replace") or 0) if model_type in ("deepseek_v3", "glm4_moe") else 0
        mlps = dense_layers * dense_mlp + (layers - dense_layers) * moe
    else:
        mlps = layers * dense_mlp
    embeddings = vocab * h * (1 if hf.get("tie_word_embeddings") else 2)
    norms = 4 if model_type in ("gemma3_text", "gemma3") else 2   # Gemma: a norm before and after attention and the MLP
    mixers = layers * attn
    if model_type in HYBRID_TYPES:   # Gated DeltaNet layers in place of attention where layer_types says
        linear = layer_kinds(hf).count("linear_attention")
        mixers = (layers - linear) * attn + linear * _deltanet_params(hf)
    return mixers + layers * norms * h + mlps + embeddings + h


def _deltanet_params(hf: dict) -> int:
    """One Gated DeltaNet layer: input projections (q, k, v, z, b, a), the depthwise conv over
    q|k|v, A_log and dt_bias per value head, the gated norm, the output projection."""
    h, nk, nv = hf["hidden_size"], hf["linear_num_key_heads"], hf["linear_num_value_heads"]
    qk, v = nk * hf["linear_key_head_dim"], nv * hf["linear_value_head_dim"]
    conv = (2 * qk + v) * int(hf.get("linear_conv_kernel_dim") or 4)
    return h * (2 * qk + 2 * v + 2 * nv) + conv + 2 * nv + hf["linear_value_head_dim"] + v * h


def deltanet_flops_per_token(hf: dict) -> int:
    """Forward FLOPs of the gated delta rule per token, all Gated DeltaNet layers (what the 2 x
    params rule misses, like attention's own FLOPs, but linear in the tokens): per value head the
    state's decay (d_k d_v), the recall S^T k, the rank-1 update and the read S^T q (2 d_k d_v each)."""
    if hf.get("model_type") not in HYBRID_TYPES:
        return 0
    linear = layer_kinds(hf).count("linear_attention")
    return linear * hf["linear_num_value_heads"] * 7 * hf["linear_key_head_dim"] * hf["linear_value_head_dim"]


def _mla_params(hf: dict) -> int:
    """One multi-latent attention block: q (through its bottleneck and norm, or one projection),
    the k/v latent with the shared RoPE key, its norm, the k/v up projection and the output."""
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    qk = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]
    q_rank, kv_rank = hf.get("q_lora_rank"), hf["kv_lora_rank"]
    q = h * heads * qk if not q_rank else h * q_rank + q_rank + q_rank * heads * qk
    kv = h * (kv_rank + hf["qk_rope_head_dim"]) + kv_rank + kv_rank * heads * (hf["qk_nope_head_dim"] + hf["v_head_dim"])
    return q + kv + heads * hf["v_head_dim"] * h


def actor_mfu(metrics: Mapping[str, float], hf: dict, world: int, device_name: str) -> dict[str, float]:
    """`throughput/actor_mfu`: model FLOPs of the actor update (6 x active params x tokens, plus 3 x
    the gated delta rule's forward FLOPs of hybrid models; the attention's own FLOPs left out) per
    second, over the world's bf16 peak; {} when unknown."""
    peak = peak_bf16_flops(device_name)
    rate = metrics.get("throughput/train_tokens_per_s")
    if not peak or not rate:
        return {}
    per_token = 6 * model_params(hf) + 3 * deltanet_flops_per_token(hf)
    return {"throughput/actor_mfu": per_token * rate / (world * peak)}
