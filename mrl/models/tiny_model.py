"""A tiny megatron-core GPTModel for platform tests: `mrl.models.megatron` at toy sizes.

Llama-shaped (RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases, untied embeddings by
default), optionally MoE, fp32, every CUDA-only fusion off, weights drawn whole on every rank so
one seed gives the same model at any TP/EP size. Parallel sizes come from megatron's state.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from mrl.models.megatron import (  # noqa: F401  (re-exported for the tests)
    build_gpt,
    gather_vocab_parallel_logits,
    parallel_from_state,
    position_ids,
    transformer_config,
)


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

    def hf_config(self, share_embeddings: bool = False) -> dict[str, Any]:
        """The equivalent Hugging Face (Llama/Mixtral-style) config dict."""
        cfg = dict(model_type="llama", vocab_size=self.vocab_size, max_position_embeddings=self.seq_length,
                   num_hidden_layers=self.num_layers, hidden_size=self.hidden_size,
                   num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_query_groups,
                   intermediate_size=self.ffn_hidden_size, initializer_range=self.init_method_std,
                   rms_norm_eps=1e-5, tie_word_embeddings=share_embeddings)
        if self.num_moe_experts:
            cfg.update(num_experts=self.num_moe_experts, num_experts_per_tok=self.moe_router_topk,
                       moe_intermediate_size=self.moe_ffn_hidden_size or self.ffn_hidden_size)
        return cfg


def tiny_gpt_config(spec: TinyGPTSpec = TinyGPTSpec(), **overrides):
    """A `TransformerConfig` for `spec` on megatron's current parallel layout; `overrides` win."""
    return transformer_config(spec.hf_config(), dtype="float32", parallel=parallel_from_state(), device="cpu",
                              **overrides)


def build_tiny_gpt(spec: TinyGPTSpec = TinyGPTSpec(), *, config=None, pre_process: Optional[bool] = None,
                   post_process: Optional[bool] = None, vp_stage: Optional[int] = None,
                   share_embeddings: bool = False, attention: str = "auto"):
    """This rank's TP/PP/EP shard of the tiny model (megatron's local, non-TE, layer spec with mrl's
    attention backend `attention`; "reference" keeps megatron's unfused attention, which takes a
    dense mask: `block_causal_mask`)."""
    return build_gpt(spec.hf_config(share_embeddings), config or tiny_gpt_config(spec), vp_stage=vp_stage,
                     vocab_multiple=1, max_sequence_length=spec.seq_length, pre_process=pre_process,
                     post_process=post_process, attention=attention)


def block_causal_mask(lengths: list[int]):
    """The dense `[1, 1, T, T]` block-diagonal causal mask (True = masked) of sequences of
    `lengths` packed in one row: the input of the `reference` attention, for tests only."""
    import torch

    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.as_tensor(lengths))
    ar = torch.arange(len(seg))
    mask = (seg.unsqueeze(0) != seg.unsqueeze(1)) | (ar.unsqueeze(0) > ar.unsqueeze(1))
    return mask.view(1, 1, len(seg), len(seg))
