"""Hugging Face architecture configs -> megatron-core GPTModel shards on this rank's layout.

Supported decoder families: Llama/Mistral (RMSNorm, SwiGLU, RoPE, GQA), Qwen2 (plus QKV bias),
Qwen3 (plus QK-norm), Qwen3-MoE (plus routed experts, softmax router, top-k optionally
renormalised, dense MLPs in `mlp_only_layers`), Qwen2-MoE (Qwen2 attention with QKV bias, the
Qwen3-MoE router, plus a shared expert scaled by a sigmoid gate), Mixtral (routed experts,
renormalised top-k), DeepSeek-V3 (multi-latent attention, `models.sigmoid_moe`; Kimi-K2 is read
as it) and GLM-4.5 (`glm4_moe`: GQA with QKV bias, RoPE on half of each head, `models.sigmoid_moe`).
RoPE uses the checkpoint's inverse frequencies as `transformers` computes them (default,
linear and llama3 scaling; partial rotation per `partial_rotary_factor`).
`architecture_problems` lists, one line each, what a config asks that mrl does not build.
Weights here are random (megatron's init); loading Hugging Face weights is the weight-mapping
layer's job.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from mrl.errors import UserError
from mrl.models.config import ModelConfig
from mrl.models.facts import (ARCHITECTURES, BUILTIN_PRESETS, MODEL_TYPE_ALIASES, builtin_preset, canonical_config,
                              find_hf_config)
from mrl.models.sigmoid_moe import sigmoid_moe_fields
from mrl.models.vlm import complete as complete_vlm
from mrl.models.vlm import is_vlm, mrope_section
from mrl.platform.config import ParallelConfig

SUPPORTED_MODEL_TYPES = tuple(t for t in ARCHITECTURES if t not in MODEL_TYPE_ALIASES) + ("qwen2_5_vl", "qwen3_vl")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Model types transformers builds that mrl does not map yet, and what is missing (issue 40).
UNMAPPED_MODEL_TYPES = {
    "gemma3_text": "sliding-window layers with their own RoPE base, Gemma's (1 + w) RMSNorms, the post-attention "
                   "and post-feed-forward norms, the embedding scale and the GELU-tanh MLP are not built",
    "gpt_oss": "attention sinks, alternating sliding-window layers, the clamped SwiGLU with biases and MXFP4 "
               "checkpoint weights are not built",
    "qwen3_next": "gated DeltaNet linear-attention layers and gated full attention are not built",
    "qwen3_5_text": "gated DeltaNet linear-attention layers and gated full attention are not built",
    "qwen3_5_moe_text": "gated DeltaNet linear-attention layers and gated full attention are not built",
}
UNMAPPED_MODEL_TYPES.update(gemma3=UNMAPPED_MODEL_TYPES["gemma3_text"], qwen3_5=UNMAPPED_MODEL_TYPES["qwen3_5_text"],
                            qwen3_5_moe=UNMAPPED_MODEL_TYPES["qwen3_5_moe_text"])
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
        why = f" yet: {UNMAPPED_MODEL_TYPES[model_type]}" if model_type in UNMAPPED_MODEL_TYPES else ""
        raise UserError(f"model.path: model_type {model_type!r} is not supported{why} (supported: "
                        f"{', '.join(SUPPORTED_MODEL_TYPES)}, and {', '.join(f'{a} as {t}' for a, t in MODEL_TYPE_ALIASES.items())})")
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise UserError(f"model.path: quantized checkpoint (quantization_config {method!r}) is not supported; mrl trains "
                        "unquantized weights (dequantize the checkpoint to bf16 first)")
    if is_vlm(cfg):
        return complete_vlm(cfg)
    rest = {k: v for k, v in cfg.items() if k != "model_type"}
    full = AutoConfig.for_model(model_type, **rest).to_dict()
    return {**full, "model_type": model_type}


def architecture_problems(cfg: dict[str, Any], tensor_parallel: int = 1) -> list[str]:
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
    problems = []
    for check in checks:
        try:
            check(hf)
        except UserError as e:
            problems.append(str(e))
    return problems


def model_problems(path: str, tensor_parallel: int = 1) -> list[str]:
    """`architecture_problems` of the config at `model.path` (none when it cannot be read here)."""
    found = find_hf_config(path)
    return [] if found is None else architecture_problems(found[0], tensor_parallel)


def _check_sliding_window(hf: dict[str, Any]) -> None:
    """Sliding-window attention is not built: refuse a window that masks anything (Mistral's
    `sliding_window`, which transformers defaults to 4096; Qwen's `use_sliding_window` layers),
    unless it is at least `max_position_embeddings` long."""
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    active = ("sliding_attention" in layer_types if layer_types
              else bool(window) and hf.get("use_sliding_window") is not False)
    if active and window and int(window) < int(hf.get("max_position_embeddings") or 0):
        raise UserError(f"model.path: sliding-window attention (sliding_window {window} < max_position_embeddings "
                        f"{hf['max_position_embeddings']}) is not supported: mrl attends over whole sequences (set "
                        "sliding_window to null in config.json if the model does not need it)")


def _check_activation(hf: dict[str, Any]) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(f"model.path: hidden_act {hf['hidden_act']!r} is not supported (silu only)")


def rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """The RoPE type and parameters, from transformers 5's `rope_parameters` or the older
    `rope_theta` / `rope_scaling` fields."""
    params = dict(hf.get("rope_parameters") or {})
    if not params:
        params = dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def hf_inv_freq(hf: dict[str, Any]) -> torch.Tensor:
    """RoPE inverse frequencies exactly as `transformers` computes them for this config."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = rope_parameters(hf)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UserError(f"model.path: RoPE type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        base = float(params["rope_theta"])
        dim = int((hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]) * rotary_fraction(hf))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    cfg = AutoConfig.for_model(**hf)   # (not for the default type: a flat VLM config would warn about its mRoPE keys)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
    if attention_factor != 1.0:
        raise UserError(f"model.path: RoPE type {rope_type!r} with attention factor {attention_factor} is not supported")
    return inv_freq.float()


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
    if hf.get("model_type") == "qwen2_moe" and hf.get("shared_expert_intermediate_size"):
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
        ffn_hidden_size=hf["intermediate_size"],
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
        mrope_section=mrope_section(hf) if is_vlm(hf) else None,
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
    if experts and model_type not in ("deepseek_v3", "glm4_moe"):
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


def model_backend(hf: dict[str, Any], attention: str, device: str, context: int = 1) -> str:
    """The core-attention backend for `hf` (`mrl.models.attention.resolve_backend`). Vision-language
    models take mrl's packed RoPE (per-token multimodal angles): Transformer Engine's `thd` RoPE, fused
    or not, and megatron's own (`reference`) index one table by position in the sequence."""
    from mrl.models import attention as attn

    backend = attn.resolve_backend(attention, device, context)
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
