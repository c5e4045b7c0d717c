"""A tiny megatron-core GPTModel for platform tests and the CPU demo.

Llama-shaped (RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases, untied embeddings by default),
optionally MoE, fp32, with every CUDA-only fusion off so that it runs on both platforms. The model
definitions proper belong in `mrl/models/`; this stays the minimal stand-in until that exists.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class TinyGPTSpec:
    """Shape of the tiny model. Head counts must divide by the TP size used."""

    vocab_size: int = 128
    seq_length: int = 16
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 128
    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    init_method_std: float = 0.02


def tiny_gpt_config(spec: TinyGPTSpec = TinyGPTSpec(), **overrides):
    """A `TransformerConfig` for `spec`, with the parallel sizes taken from megatron's parallel state."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    pp = ps.get_pipeline_model_parallel_world_size()
    kwargs = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        ffn_hidden_size=spec.ffn_hidden_size,
        kv_channels=spec.hidden_size // spec.num_attention_heads,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=spec.init_method_std,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32 if pp > 1 else None,
        use_cpu_initialization=True,
        # Every fusion is a CUDA kernel (or needs one); off on both platforms for bit-comparable tests.
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        sequence_parallel=False,
    )
    if spec.num_moe_experts:
        kwargs.update(
            num_moe_experts=spec.num_moe_experts,
            moe_router_topk=spec.moe_router_topk,
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size or spec.ffn_hidden_size,
            moe_token_dispatcher_type="alltoall",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
        )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_tiny_gpt(spec: TinyGPTSpec = TinyGPTSpec(), *, config=None, pre_process: Optional[bool] = None,
                   post_process: Optional[bool] = None, vp_stage: Optional[int] = None,
                   share_embeddings: bool = False):
    """Build the GPTModel (this rank's TP/PP/EP shard) with megatron's local (non-TE) layer spec.

    Weights come from the default torch generator via `use_cpu_initialization`: every rank draws
    the full tensor and keeps its shard, so the same seed gives the same model at any TP/EP size.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = config or tiny_gpt_config(spec)
    layer_spec = get_gpt_layer_local_spec(num_experts=spec.num_moe_experts, moe_grouped_gemm=False,
                                          normalization="RMSNorm")
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=share_embeddings,
        position_embedding_type="rope",
        vp_stage=vp_stage,
    )


def causal_attention_mask(batch: int, seq: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Megatron's boolean attention mask, shape [batch, 1, seq, seq], True = masked (the future).

    Passing it explicitly keeps megatron from building its default mask on `device="cuda"`.
    """
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)
    return mask.view(1, 1, seq, seq).expand(batch, 1, seq, seq).contiguous()


def position_ids(batch: int, seq: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq).contiguous()


def gather_vocab_parallel_logits(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits from the TP-sharded output layer (differentiable all-gather)."""
    from megatron.core import tensor_parallel

    return tensor_parallel.gather_from_tensor_model_parallel_region(logits.contiguous())
