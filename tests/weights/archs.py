"""Tiny random Hugging Face models, one per supported architecture, saved as safetensors."""
from __future__ import annotations

import json
from pathlib import Path

import torch

_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=250, max_position_embeddings=128, rms_norm_eps=1e-6)

# Vocab 250 is deliberately not a multiple of 128 x TP: the Megatron side pads it.
ARCHS: dict[str, dict] = {
    "llama": dict(model_type="llama", intermediate_size=96, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 32}),
    "qwen2": dict(model_type="qwen2", intermediate_size=96, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", intermediate_size=96, head_dim=32, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0}),
    "qwen3_moe": dict(model_type="qwen3_moe", intermediate_size=96, moe_intermediate_size=48, head_dim=16,
                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False),
    "qwen2_moe": dict(model_type="qwen2_moe", intermediate_size=96, moe_intermediate_size=48,
                      shared_expert_intermediate_size=80, num_experts=4, num_experts_per_tok=2,
                      norm_topk_prob=False, tie_word_embeddings=False),
    # MLA with a q bottleneck, group-limited sigmoid routing (8 experts in 4 groups, the best 2
    # groups, top 4), a shared expert, layer 0 dense; heads = KV heads as in DeepSeek-V3.
    "deepseek_v3": dict(model_type="deepseek_v3", num_key_value_heads=4, intermediate_size=96,
                        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=4,
                        n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        tie_word_embeddings=False),
    # Kimi-K2's config as published (model_type kimi_k2, DeepSeek-V3's architecture): one routing
    # group, yarn RoPE in the legacy `rope_scaling` form with mscale_all_dim 1, the remote code's
    # routing fields, no MTP layers; written under its own model_type (see make_hf_model).
    "kimi_k2": dict(model_type="kimi_k2", num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32,
                    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                    first_k_dense_replace=1, moe_layer_freq=1, routed_scaling_factor=2.827, scoring_func="sigmoid",
                    topk_method="noaux_tc", norm_topk_prob=True, num_nextn_predict_layers=0,
                    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                    rope_theta=50000.0, rope_scaling=dict(type="yarn", factor=4.0, beta_fast=1.0, beta_slow=1.0,
                                                          mscale=1.0, mscale_all_dim=1.0,
                                                          original_max_position_embeddings=32),
                    tie_word_embeddings=False),
    # GLM-4.5's shape: half-head RoPE, QKV bias, QK-norm (GLM-4.6 style), layer 0 dense, sigmoid
    # routing with the correction bias over 2 groups (best 1, top 2), a shared expert.
    "glm4_moe": dict(model_type="glm4_moe", intermediate_size=96, moe_intermediate_size=32, head_dim=16,
                     n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                     first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True,
                     use_qk_norm=True, partial_rotary_factor=0.5, rope_theta=1000000.0, tie_word_embeddings=False),
    # gpt-oss' shape: sinks, biases, a 4-token window in layer 0 (full attention in layer 1), yarn
    # RoPE with its attention factor (positions past the original 32 matter), 4 experts (top 2) with
    # biases; swiglu_limit 0.5 so the clamp of the SwiGLU acts on these weights (gpt-oss: 7).
    "gpt_oss": dict(model_type="gpt_oss", intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=4, swiglu_limit=0.5, router_aux_loss_coef=0.0,
                    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                                         beta_slow=1.0, truncate=False, original_max_position_embeddings=32),
                    tie_word_embeddings=False),
    # Gemma 3's text model: layer 0 sliding (4 tokens, local RoPE base 10000), layer 1 global (linear
    # x4 RoPE), query_pre_attn_scalar 24 (not the head dim 16), tied embeddings scaled by sqrt(64).
    "gemma3_text": dict(model_type="gemma3_text", intermediate_size=96, head_dim=16, query_pre_attn_scalar=24,
                        sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                                         "full_attention": dict(rope_type="linear", rope_theta=1000000.0,
                                                                factor=4.0)},
                        tie_word_embeddings=True),
    # Qwen3-Next's shape: layer 0 a Gated DeltaNet (2 key heads, 4 value heads of 16, conv kernel 4),
    # layer 1 gated attention with QK-norm and RoPE on a quarter of each head; 4 experts (top 2,
    # renormalised) with the gated shared expert. Probe sequences of 12 tokens; the DeltaNet tests
    # (tests/models/test_gated_deltanet.py) cross the chunked reference's 64-token chunks.
    "qwen3_next": dict(model_type="qwen3_next", intermediate_size=96, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, head_dim=16, num_experts=4, num_experts_per_tok=2,
                       norm_topk_prob=True, router_aux_loss_coef=0.0, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
                       partial_rotary_factor=0.25, tie_word_embeddings=False),
    # Qwen3.5's text models: Qwen3.5's four DeltaNet input projections, layer 0 full attention and
    # layer 1 linear (the other order from qwen3_next's), dense or with Qwen3-Next's experts.
    "qwen3_5_text": dict(model_type="qwen3_5_text", intermediate_size=96, head_dim=16, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                         linear_conv_kernel_dim=4, layer_types=["full_attention", "linear_attention"],
                         tie_word_embeddings=True),
    "qwen3_5_moe_text": dict(model_type="qwen3_5_moe_text", moe_intermediate_size=32, shared_expert_intermediate_size=48,
                             head_dim=16, num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.0,
                             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                             linear_value_head_dim=16, linear_conv_kernel_dim=4,
                             layer_types=["linear_attention", "full_attention"], tie_word_embeddings=False),
    "mixtral": dict(model_type="mixtral", intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                    tie_word_embeddings=False),
}


def make_hf_model(arch: str, out_dir: str | Path, seed: int = 0, **overrides):
    """Build `arch` with random weights (norms perturbed away from 1), save it, return the model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mrl.models.facts import canonical_config

    raw = {**_COMMON, **ARCHS[arch], **overrides}
    cfg = canonical_config(raw)   # an aliased type (kimi_k2) is built as its architecture
    config = AutoConfig.for_model(**cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:   # norms, biases: not their trivial init
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
            else:
                p.normal_(0.0, 0.08, generator=g)
        for name, b in model.named_buffers():   # DeepSeek-V3's router correction bias: it changes routes
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    model.save_pretrained(out_dir)
    if cfg["model_type"] != raw["model_type"]:   # the checkpoint's own config.json, as its authors ship it
        saved = json.loads((Path(out_dir) / "config.json").read_text())
        saved = {k: v for k, v in saved.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
        (Path(out_dir) / "config.json").write_text(json.dumps({**saved, **raw}, indent=2))
    return model


def probe_tokens(vocab: int, batch: int = 2, seq: int = 12, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def copy_config(src: str | Path, out: str | Path) -> None:
    """`src`'s config.json into `out` as transformers loads it: an aliased model type (kimi_k2) as
    its architecture's, which is what `mrl merge` writes."""
    from mrl.models.facts import canonical_config

    cfg = json.loads((Path(src) / "config.json").read_text())
    (Path(out) / "config.json").write_text(json.dumps(canonical_config(cfg), indent=2))
