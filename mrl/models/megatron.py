"""Hugging Face architecture configs -> megatron-core GPTModel shards on this rank's layout.

Supported decoder families: Llama/Mistral (RMSNorm, SwiGLU, RoPE, GQA), Qwen2 (plus QKV bias),
Qwen3 (plus QK-norm), Qwen3-MoE (plus routed experts, softmax router, top-k optionally
renormalised, dense MLPs in `mlp_only_layers`), Qwen2-MoE (Qwen2 attention with QKV bias, the
Qwen3-MoE router, plus a shared expert scaled by a sigmoid gate), Mixtral (routed experts,
renormalised top-k), DeepSeek-V3 (multi-latent attention, `models.sigmoid_moe`; Kimi-K2 is read
as it), GLM-4.5 (`glm4_moe`: GQA with QKV bias, RoPE on half of each head, `models.sigmoid_moe`),
gpt-oss (`gpt_oss`: attention sinks, sliding-window layers, the clamped SwiGLU, `models.gpt_oss`)
and Gemma 3's text model (`gemma3_text`: (1 + w) and sandwich norms, local/global RoPE, `models.gemma3`),
also as the language model of the multimodal Gemma 3 (`gemma3`, `models.gemma3_vlm`), and the
Qwen3-Next / Qwen3.5 hybrids (`qwen3_next`, `qwen3_5_text`, `qwen3_5_moe_text`: Gated DeltaNet
and gated-attention layers, `models.gated_deltanet`).
RoPE uses the checkpoint's inverse frequencies as `transformers` computes them (default,
linear, llama3 and yarn scaling, yarn's attention factor in the softmax scale; partial rotation
per `partial_rotary_factor`).
`architecture_problems` lists, one line each, what a config asks that mrl does not build.
Weights here are random (megatron's init); loading Hugging Face weights is the weight-mapping
layer's job.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from mrl.errors import UserError
from mrl.models.config import ModelConfig
from mrl.models.facts import (ARCHITECTURES, BUILTIN_PRESETS, MODEL_TYPE_ALIASES, builtin_preset, canonical_config,
                              find_hf_config)
from mrl.models import gemma3
from mrl.models import gated_deltanet as gdn
from mrl.models.gemma3 import gemma3_fields
from mrl.models.gpt_oss import check_context_parallel, check_expert_bias, gpt_oss_fields, sliding_window_fields
from mrl.models.mla import deepseek_v3_fields, rope_parameters
from mrl.models.sigmoid_moe import sigmoid_moe_fields
from mrl.models.vlm import complete as complete_vlm
from mrl.models.vlm import is_vlm, mrope_section, uses_mrope
from mrl.platform.config import ParallelConfig

SUPPORTED_MODEL_TYPES = tuple(t for t in ARCHITECTURES if t not in MODEL_TYPE_ALIASES) + ("qwen2_5_vl", "qwen3_vl", "gemma3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Quantized checkpoints mrl dequantizes on load (`mrl.weights.stacked`), by model type.
DEQUANTIZED_ON_LOAD = {"gpt_oss": ("mxfp4",)}
from mrl.platform.device import DTYPES as _DTYPES


def hf_config(model: ModelConfig) -> dict[str, Any]:
    """The model's Hugging Face config: a builtin preset, `<path>/config.json`, or the HF cache,
    completed with `transformers`' defaults for its architecture."""
    found = find_hf_config(model.path)
    if found is None:
        if builtin_preset(model.path) is not None:
            raise UserError(f"model.path: unknown builtin preset {model.path!r} (presets: {', '.join(BUILTIN_PRESETS)})")
        raise UserError(f"model.path: no config.json for {model.path!r} here (a local Hugging Face model "
                        "directory, or a Hub id already in the Hugging Face cache, is needed)")
    return complete_hf_config(found[0])


def complete_hf_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with every field its `transformers` config class defaults (e.g. `norm_topk_prob`,
    `rope_parameters`), so mrl reads the architecture exactly as `transformers` does; an aliased
    model type (kimi_k2) becomes its architecture's (`facts.canonical_config`)."""
    from transformers import AutoConfig

    cfg = canonical_config(cfg)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"model.path: model_type {model_type!r} is not supported (supported: "
                        f"{', '.join(SUPPORTED_MODEL_TYPES)}, and {', '.join(f'{a} as {t}' for a, t in MODEL_TYPE_ALIASES.items())})")
    quant = cfg.get("quantization_config")
    if quant and isinstance(quant, dict) and quant.get("quant_method") in DEQUANTIZED_ON_LOAD.get(model_type, ()):
        quant = None   # its weights are dequantized as they are read; training is in the job's dtype
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise UserError(f"model.path: quantized checkpoint (quantization_config {method!r}) is not supported; mrl trains "
                        "unquantized weights (dequantize the checkpoint to bf16 first)")
    if is_vlm(cfg):
        return complete_vlm(cfg)
    rest = {k: v for k, v in cfg.items() if k != "model_type"}
    full = AutoConfig.for_model(model_type, **rest).to_dict()
    return {**full, "model_type": model_type}


def architecture_problems(cfg: dict[str, Any], tensor_parallel: int = 1, context_parallel: int = 1,
                          expert_tensor: int | None = None) -> list[str]:
    """Every reason mrl cannot build the checkpoint config `cfg` exactly, one `"key: reason"` line
    each: what `mrl validate` reports, from the checks `mrl train` refuses with (model type,
    quantization, activation, RoPE type, each architecture's own refusals)."""
    try:
        hf = complete_hf_config(cfg)
    except UserError as e:
        return [str(e)]
    checks = [_check_activation, _check_sliding_window]
    if hf["model_type"] == "deepseek_v3":   # MLA takes its own RoPE types (default, yarn) and TP rules
        checks.append(lambda h: deepseek_v3_fields({**h, "_tensor_parallel": tensor_parallel}))
    else:
        checks.append(hf_inv_freq)
    if hf["model_type"] == "glm4_moe":
        checks.append(lambda h: sigmoid_moe_fields(h, "glm4_moe"))
    if hf["model_type"] == "gpt_oss":
        checks += [gpt_oss_fields, lambda h: check_expert_bias(expert_tensor or tensor_parallel)]
    if hf["model_type"] in GEMMA3_TYPES:
        checks += [gemma3_fields, lambda h: hf_inv_freq(h, "sliding_attention")]
    if _builds_windows(hf) or hf["model_type"] == "gpt_oss":
        checks.append(lambda h: check_context_parallel(h, context_parallel))
    if hf["model_type"] in gdn.HYBRID_TYPES:
        checks.append(lambda h: gdn.hybrid_fields(h, tensor_parallel, context_parallel))
    problems = []
    for check in checks:
        try:
            check(hf)
        except UserError as e:
            problems.append(str(e))
    return problems


def model_problems(path: str, tensor_parallel: int = 1, context_parallel: int = 1,
                   expert_tensor: int | None = None) -> list[str]:
    """`architecture_problems` of the config at `model.path` (none when it cannot be read here)."""
    found = find_hf_config(path)
    return [] if found is None else architecture_problems(found[0], tensor_parallel, context_parallel, expert_tensor)


# Model types whose sliding-window layers mrl builds (`models.gpt_oss.sliding_window_fields`).
WINDOWED_TYPES = ("gpt_oss", "gemma3_text", "gemma3")
#: Gemma 3's text model and the multimodal Gemma 3 (its language model is the text model)
GEMMA3_TYPES = ("gemma3_text", "gemma3")


def _builds_windows(hf: dict[str, Any]) -> bool:
    return hf.get("model_type") in WINDOWED_TYPES and bool(sliding_window_fields(hf))


def _check_sliding_window(hf: dict[str, Any]) -> None:
    """Sliding-window attention is built for `WINDOWED_TYPES` only: for the others refuse a window
    that masks anything (Mistral's `sliding_window`, which transformers defaults to 4096; Qwen's
    `use_sliding_window` layers), unless it is at least `max_position_embeddings` long."""
    if hf.get("model_type") in WINDOWED_TYPES:
        return
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    active = ("sliding_attention" in layer_types if layer_types
              else bool(window) and hf.get("use_sliding_window") is not False)
    if active and window and int(window) < int(hf.get("max_position_embeddings") or 0):
        raise UserError(f"model.path: sliding-window attention (sliding_window {window} < max_position_embeddings "
                        f"{hf['max_position_embeddings']}) is not supported: mrl attends over whole sequences (set "
                        "sliding_window to null in config.json if the model does not need it)")


def _check_activation(hf: dict[str, Any]) -> None:
    if hf.get("model_type") in GEMMA3_TYPES:   # its own (models.gemma3)
        return
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(f"model.path: hidden_act {hf['hidden_act']!r} is not supported (silu only)")


def hf_inv_freq(hf: dict[str, Any], layer_type: str | None = None) -> torch.Tensor:
    """RoPE inverse frequencies exactly as `transformers` computes them for this config (for the
    layers of `layer_type` where the config has RoPE per layer type)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = rope_parameters(hf, layer_type)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UserError(f"model.path: RoPE type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        base = float(params["rope_theta"])
        dim = int((hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]) * rotary_fraction(hf))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    cfg = AutoConfig.for_model(**_text_form(hf))   # (not for the default type: a flat VLM config would warn about its mRoPE keys)
    per_layer = {"layer_type": layer_type or "full_attention"} if "full_attention" in (hf.get("rope_parameters") or {}) else {}
    inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"), **per_layer)
    rope_attention_factor(hf)   # its refusals
    return inv_freq.float()


def _text_form(hf: dict[str, Any]) -> dict[str, Any]:
    """`hf` as `transformers`' RoPE helpers read it: the multimodal Gemma 3's text config."""
    if hf.get("model_type") == "gemma3":
        from mrl.models.gemma3_vlm import text_config

        return text_config(hf)
    return hf


def rope_attention_factor(hf: dict[str, Any]) -> float:
    """The factor `transformers` multiplies RoPE's cos and sin by (yarn's `attention_factor`; 1 for
    the other types). Rotating q and k each by `m` scales every attention logit by `m^2`, so mrl
    folds it into the softmax scale (`transformer_config`). With partial RoPE the unrotated channels
    are not scaled: refused."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = rope_parameters(hf)["rope_type"]
    if rope_type in ("default", "linear", "llama3") or rope_type not in SUPPORTED_ROPE_TYPES:
        return 1.0
    if "full_attention" in (hf.get("rope_parameters") or {}):
        raise UserError(f"model.path: RoPE type {rope_type!r} per layer type is not supported (default, linear)")
    _, factor = ROPE_INIT_FUNCTIONS[rope_type](AutoConfig.for_model(**_text_form(hf)), torch.device("cpu"))
    if factor != 1.0 and rotary_fraction(hf) != 1.0:
        raise UserError(f"model.path: RoPE type {rope_type!r} with attention factor {factor} on part of each head "
                        "(partial_rotary_factor) is not supported")
    if factor != 1.0 and is_vlm(hf):
        raise UserError(f"model.path: RoPE type {rope_type!r} with attention factor {factor} is not supported for "
                        "vision-language models")
    return float(factor)


def rotary_fraction(hf: dict[str, Any]) -> float:
    """The part of each head RoPE rotates (`partial_rotary_factor`: GLM-4.5's 0.5; megatron's
    `rotary_percent`): its first `head_dim x fraction` channels, the `rotate_half` way."""
    return float(rope_parameters(hf).get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 1.0)


def moe_layer_pattern(hf: dict[str, Any]) -> list[int] | None:
    """Per layer 1 (routed experts) or 0 (dense MLP), for MoE configs that mix the two."""
    dense = set(hf.get("mlp_only_layers") or ())
    step = hf.get("decoder_sparse_step") or 1
    pattern = [0 if (i in dense or (i + 1) % step) else 1 for i in range(hf["num_hidden_layers"])]
    return None if all(pattern) else pattern


def shared_experts(hf: dict[str, Any]) -> dict[str, Any]:
    """TransformerConfig fields for an MoE layer's always-on shared expert: Qwen2-MoE's one
    `shared_expert` of `shared_expert_intermediate_size`, scaled by `sigmoid(shared_expert_gate(x))`
    (megatron's `moe_shared_expert_gate`, the same formula)."""
    if hf.get("model_type") in ("qwen2_moe",) + gdn.HYBRID_TYPES and hf.get("shared_expert_intermediate_size"):
        return dict(moe_shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
                    moe_shared_expert_gate=True)
    return {}


def padded_vocab_size(vocab_size: int, tensor_parallel: int, multiple: int = 128) -> int:
    """Vocabulary padded so every TP rank holds an equal, aligned slice (as Megatron training does)."""
    step = multiple * tensor_parallel
    return -(-vocab_size // step) * step


def parallel_from_state() -> ParallelConfig:
    """The `ParallelConfig` megatron's parallel state was initialised with."""
    from mrl.platform.parallel import current_layout

    layout = current_layout()
    return ParallelConfig(tensor=layout.tp, pipeline=layout.pp, virtual_pipeline=layout.vpp, context=layout.cp,
                          expert=layout.ep, expert_tensor=layout.etp)


def transformer_config(hf: dict[str, Any], *, dtype: str, parallel: ParallelConfig, device: str,
                       recompute: str = "none", attention: str = "auto", fused: bool = True, **overrides):
    """A megatron `TransformerConfig` for the HF config `hf` on the job's parallel layout.

    On cpu, weights are drawn whole on every rank and sliced (`use_cpu_initialization`), so one
    seed gives the same model at any TP/EP size. Transformer Engine's fusions (RoPE, weight-gradient
    accumulation, grouped GEMM) are on when `attention` resolves to `te`; `fused` (the job's
    `model.use_fused_kernels`) turns on megatron's compiled SwiGLU on cuda. `overrides` are
    TransformerConfig fields.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"model.path: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    _check_activation(hf)
    _check_sliding_window(hf)
    torch_dtype = _DTYPES[dtype]
    heads = hf["num_attention_heads"]
    te = model_backend(hf, attention, device, parallel.context) == "te"
    kwargs: dict[str, Any] = dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf.get("intermediate_size") or hf["moe_intermediate_size"],   # (Qwen3.5-MoE: experts only)
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        normalization="RMSNorm",
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=(model_type in ("qwen2", "qwen2_5_vl") or bool(hf.get("attention_bias", False))
                      or (model_type == "qwen2_moe" and bool(hf.get("qkv_bias", True)))),
        qk_layernorm=model_type in ("qwen3", "qwen3_moe", "qwen3_vl") or (model_type == "glm4_moe" and bool(hf.get("use_qk_norm"))),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=hf.get("initializer_range", 0.02),
        params_dtype=torch_dtype,
        bf16=torch_dtype is torch.bfloat16,
        fp16=torch_dtype is torch.float16,
        pipeline_dtype=torch_dtype if parallel.pipeline > 1 else None,
        use_cpu_initialization=device == "cpu",
        gradient_accumulation_fusion=te,
        bias_activation_fusion=device == "cuda" and fused,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=te,
        mrope_section=mrope_section(hf) if uses_mrope(hf) else None,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        tensor_model_parallel_size=parallel.tensor,
        pipeline_model_parallel_size=parallel.pipeline,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline,
        context_parallel_size=parallel.context,
        expert_model_parallel_size=parallel.expert,
        expert_tensor_parallel_size=parallel.expert_tensor or parallel.tensor,
        sequence_parallel=parallel.sequence_parallel,
    )
    if recompute == "selective":
        kwargs.update(recompute_granularity="selective")
    elif recompute == "full":
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    if experts and model_type not in ("deepseek_v3", "glm4_moe", "gpt_oss"):
        pattern = moe_layer_pattern(hf)
        if pattern is not None:
            kwargs.update(moe_layer_freq=pattern)
        kwargs.update(
            num_moe_experts=experts,
            moe_router_topk=hf["num_experts_per_tok"],
            moe_ffn_hidden_size=hf.get("moe_intermediate_size") or hf["intermediate_size"],
            moe_router_score_function="softmax",
            # top-k over logits, then softmax over the k = softmax, top-k, renormalise (norm_topk_prob)
            moe_router_pre_softmax=not hf.get("norm_topk_prob", True),
            moe_token_dispatcher_type="alltoall",
            moe_router_load_balancing_type="aux_loss" if hf.get("router_aux_loss_coef") else "none",
            moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef") or 0.0),
            moe_grouped_gemm=te,
            moe_permute_fusion=False,
        )
        kwargs.update(shared_experts(hf))
    if model_type == "gpt_oss":   # sinks, clamped SwiGLU with biases, sliding-window layers (models.gpt_oss)
        check_context_parallel(hf, parallel.context)
        check_expert_bias(parallel.expert_tensor or parallel.tensor)
        kwargs.update(gpt_oss_fields(hf), moe_grouped_gemm=te)
    if model_type in GEMMA3_TYPES:   # (1 + w) and sandwich norms, GELU-tanh, local RoPE (models.gemma3)
        check_context_parallel(hf, parallel.context)
        kwargs.update(gemma3_fields(hf))
    if model_type in gdn.HYBRID_TYPES:   # Gated DeltaNet and gated attention layers (models.gated_deltanet)
        kwargs.update(gdn.hybrid_fields(hf, parallel.tensor, parallel.context))
    if model_type != "deepseek_v3":   # yarn's attention factor on both q and k: the logits' scale times m^2
        factor = rope_attention_factor(hf)
        if factor != 1.0:
            kwargs.update(softmax_scale=factor ** 2 / math.sqrt(kwargs["kv_channels"]))
    if model_type == "glm4_moe":   # GLM-4.5: GQA attention, DeepSeek-V3's router and shared experts
        kwargs.update(sigmoid_moe_fields(hf, "glm4_moe"), moe_grouped_gemm=te, moe_permute_fusion=False)
    if model_type == "deepseek_v3":
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        kwargs.update(deepseek_v3_fields({**hf, "_tensor_parallel": parallel.tensor}),
                      moe_grouped_gemm=te, moe_permute_fusion=False)
        kwargs.update(overrides)
        return MLATransformerConfig(**kwargs)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def model_backend(hf: dict[str, Any], attention: str, device: str, context: int = 1) -> str:
    """The core-attention backend for `hf` (`mrl.models.attention.resolve_backend`). Vision-language
    models take mrl's packed RoPE (per-token multimodal angles): Transformer Engine's `thd` RoPE, fused
    or not, and megatron's own (`reference`) index one table by position in the sequence. The
    multimodal Gemma 3 takes `sdpa` on every device: its images' bidirectional blocks are an
    SDPA mask per sequence, which `te`, `varlen` and `flex` (as mrl calls them) do not take."""
    from mrl.models import attention as attn

    backend = attn.resolve_backend(attention, device, context)
    if hf.get("model_type") in gdn.HYBRID_TYPES and backend == "te":   # its DeltaNet layers take the local spec
        if attention != "auto":
            raise UserError(f"model.attention: 'te' does not build {hf['model_type']}'s Gated DeltaNet layers "
                            "(varlen or sdpa do)")
        backend = "varlen" if device == "cuda" else "sdpa"
    if hf.get("model_type") == "gemma3" and backend != "sdpa":   # its images attend both ways (models.gemma3_vlm)
        if attention != "auto":
            raise UserError(f"model.attention: {attention!r} cannot run gemma3's bidirectional image attention "
                            "(each image's tokens see each other); use 'sdpa' or 'auto'")
        return "sdpa"
    if is_vlm(hf) and backend in ("te", attn.REFERENCE):
        if attention != "auto":
            raise UserError(f"model.attention: {attention!r} cannot run {hf['model_type']}'s multimodal RoPE on "
                            "packed rows (varlen or sdpa can)")
        backend = "varlen" if device == "cuda" else "sdpa"
    return backend


def build_gpt(hf: dict[str, Any], config, *, vp_stage: int | None = None, vocab_multiple: int = 128,
              max_sequence_length: int | None = None, pre_process: bool | None = None,
              post_process: bool | None = None, attention: str = "auto", pg_collection=None):
    """This rank's GPTModel shard (one virtual-pipeline chunk) for `hf` with `config`.

    The vocabulary is padded to a multiple of `vocab_multiple x TP`; pre/post-processing (embedding,
    output layer) default to this rank's place in the pipeline. `attention` is a `model.attention`
    value (`mrl.models.attention`), resolved for the config's device. `pg_collection`: the model's own
    process groups (megatron's `ProcessGroupCollection`; default the job's), e.g. a tensor-parallel
    group of its own for a model laid out unlike the job (`mrl.train.teacher_layout`).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from mrl.models import attention as attn

    on_cuda = torch.cuda.is_available() and not config.use_cpu_initialization
    backend = model_backend(hf, attention, "cuda" if on_cuda else "cpu", config.context_parallel_size)
    layer_spec = attn.layer_specs(config, backend, vp_stage=vp_stage)
    gemma = hf.get("model_type") in GEMMA3_TYPES
    if gemma:   # post-attention and post-MLP norms around megatron's modules
        layer_spec = gemma3.sandwich_spec(layer_spec)
    if hf.get("model_type") in gdn.HYBRID_TYPES:   # Gated DeltaNet in the linear_attention layers
        layer_spec = gdn.hybrid_spec(layer_spec, hf, config, vp_stage)
    extra: dict[str, Any] = dict(position_embedding_type="rope")
    if is_vlm(hf):
        from mrl.models.vlm_gpt import VisionLanguageGPT as GPTModel   # noqa: F811 - mRoPE + vision tower

        extra = dict(hf=hf, inv_freq=hf_inv_freq(hf))
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=padded_vocab_size(hf["vocab_size"], config.tensor_model_parallel_size, vocab_multiple),
        max_sequence_length=max_sequence_length or hf.get("max_position_embeddings", 4096),
        pre_process=(ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
                     if pre_process is None else pre_process),
        post_process=(ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
                      if post_process is None else post_process),
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        **extra,
        rotary_percent=rotary_fraction(hf),
        rotary_base=int(float(rope_parameters(hf)["rope_theta"])),
        vp_stage=vp_stage,
        **({"pg_collection": pg_collection} if pg_collection is not None else {}),
    )
    if getattr(model, "rotary_pos_emb", None) is not None and not is_vlm(hf):
        model.rotary_pos_emb.inv_freq = hf_inv_freq(hf).to(model.rotary_pos_emb.inv_freq.device)
    if gemma:   # sqrt(hidden) on the embedding, the sliding layers' own RoPE base
        gemma3.scale_embeddings(model, hf)
        gemma3.local_rope(model, hf, hf_inv_freq(hf, "sliding_attention"))
    model.mrl_attention = backend
    return model


def build_model_chunks(model: ModelConfig, parallel: ParallelConfig, *, device: str, recompute: str = "none"):
    """(hf config, [GPTModel per virtual-pipeline stage]) for this rank, moved to its device."""
    hf = hf_config(model)
    config = transformer_config(hf, dtype=model.dtype, parallel=parallel, device=device, recompute=recompute,
                                attention=model.attention, fused=model.use_fused_kernels)
    stages = parallel.virtual_pipeline or 1
    chunks = [build_gpt(hf, config, vp_stage=i if parallel.virtual_pipeline else None, attention=model.attention)
              for i in range(stages)]
    if device == "cuda":
        chunks = [c.cuda(torch.cuda.current_device()) for c in chunks]
    return hf, chunks


def position_ids(batch: int, seq: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq).contiguous()


def gather_vocab_parallel_logits(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits from the TP-sharded output layer (differentiable all-gather)."""
    from megatron.core import tensor_parallel

    return tensor_parallel.gather_from_tensor_model_parallel_region(logits.contiguous())
