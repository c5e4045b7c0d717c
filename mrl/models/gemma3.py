"""Gemma 3's text model (`gemma3_text`) from megatron pieces; megatron-core 0.16.1 has no Gemma.

What `transformers`' Gemma3ForCausalLM computes, and how mrl builds it:

- RMSNorms scaling by `(1 + w)` in float32 (`Gemma3RMSNorm`): megatron's
  `layernorm_zero_centered_gamma`, computed by mrl's `RMSNorm` (`mrl.models.attention`), also as the
  QK-norms and the final norm;
- sandwich norms: a norm after attention and after the MLP, before each residual add
  (`post_attention_layernorm`, `post_feedforward_layernorm`): `GemmaAttention` / `GemmaMLP` below
  wrap megatron's modules (the pre-MLP norm is the checkpoint's `pre_feedforward_layernorm`);
- the embedding scaled by `sqrt(hidden_size)` rounded to the model dtype (`scale_embeddings`);
- sliding-window layers per `layer_types` (`models.gpt_oss.sliding_window_fields`) whose RoPE has its
  own base (`rope_parameters["sliding_attention"]`, `local_rope`); full layers the global one
  (linear scaling allowed);
- attention scaled by `query_pre_attn_scalar ** -0.5`, not the head dim;
- the GELU-tanh gated MLP (`gelu_pytorch_tanh`).
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from mrl.errors import UserError
from mrl.models.gpt_oss import sliding_window_fields


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """`gelu_pytorch_tanh`: GELU with the tanh approximation."""
    return torch.nn.functional.gelu(x, approximate="tanh")


def gemma3_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """TransformerConfig fields for a gemma3_text config (or the multimodal gemma3's flat one: its text
    model), or one-line refusals of what mrl does not build."""
    kind = hf.get("model_type") or "gemma3_text"
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise UserError(f"model.path: {kind} with {key} {hf[key]} is not supported (tanh soft-capping is "
                            "not built)")
    if hf.get("use_bidirectional_attention"):
        raise UserError(f"model.path: {kind} with use_bidirectional_attention is not supported (causal text only)")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UserError(f"model.path: {kind} hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    fields: dict[str, Any] = dict(
        layernorm_zero_centered_gamma=True,
        qk_layernorm=True,
        activation_func=gelu_tanh,
        bias_activation_fusion=False,   # megatron fuses plain gelu and swiglu only
        softmax_scale=float(hf.get("query_pre_attn_scalar") or hf["head_dim"]) ** -0.5,
        add_qkv_bias=bool(hf.get("attention_bias")),
    )
    fields.update(sliding_window_fields(hf))
    return fields


def scale_embeddings(model, hf: dict[str, Any]) -> None:
    """Multiply the embedding's output by `sqrt(hidden_size)` in its dtype, as Gemma's scaled word
    embedding (the tied output layer reads the unscaled weights)."""
    embedding = getattr(model, "embedding", None)
    if embedding is None:
        return
    scale = float(hf["hidden_size"]) ** 0.5

    def hook(module, args, output):
        return output * torch.tensor(scale, dtype=output.dtype, device=output.device)

    embedding.register_forward_hook(hook)


def local_rope(model, hf: dict[str, Any], inv_freq: torch.Tensor) -> None:
    """Give each sliding-window layer's attention the RoPE of `rope_parameters["sliding_attention"]`
    (`inv_freq`, as transformers computes it): megatron's `RotaryEmbedding` with those frequencies,
    which `GemmaAttention` uses in place of the model's table."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    decoder = getattr(model, "decoder", None)
    types = hf.get("layer_types") or []
    if decoder is None or "sliding_attention" not in types:
        return
    rope = RotaryEmbedding(kv_channels=model.config.kv_channels, rotary_percent=1.0,
                           rotary_base=int(float(rope_theta(hf, "sliding_attention"))),
                           use_cpu_initialization=model.config.use_cpu_initialization)
    rope.inv_freq = inv_freq.to(rope.inv_freq.device)
    for layer in decoder.layers:
        if types[layer.layer_number - 1] == "sliding_attention":
            object.__setattr__(layer.self_attention, "mrl_local_rope", rope)   # shared, not a submodule


def rope_theta(hf: dict[str, Any], layer_type: str) -> float:
    return float((hf.get("rope_parameters") or {}).get(layer_type, {}).get("rope_theta") or 10000.0)


@functools.lru_cache(maxsize=None)
def gemma_attention(base: type) -> type:
    """`base` (megatron's self-attention, or mrl's packed-RoPE one) with Gemma's post-attention
    norm on its output and, in sliding layers, the local RoPE table (`local_rope`)."""
    from mrl.models.attention import RMSNorm

    class GemmaAttention(base):
        mrl_local_rope = None

        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            self.post_norm = RMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon)

        def forward(self, hidden_states, *args, rotary_pos_emb=None, **kwargs):
            if self.mrl_local_rope is not None and rotary_pos_emb is not None:
                table = rotary_pos_emb[0] if isinstance(rotary_pos_emb, tuple) else rotary_pos_emb
                rotary_pos_emb = self.mrl_local_rope(table.shape[0])
            output, bias = super().forward(hidden_states, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)
            if bias is not None:
                raise ValueError("Gemma's post-attention norm takes an output without a separate bias")
            return self.post_norm(output), None

    GemmaAttention.__name__ = f"Gemma{base.__name__}"
    return GemmaAttention


@functools.lru_cache(maxsize=None)
def gemma_mlp(base: type) -> type:
    """megatron's MLP with Gemma's post-feed-forward norm on its output."""
    from mrl.models.attention import RMSNorm

    class GemmaMLP(base):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            self.post_norm = RMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon)

        def forward(self, hidden_states, *args, **kwargs):
            output, bias = super().forward(hidden_states, *args, **kwargs)
            if bias is not None:
                raise ValueError("Gemma's post-feed-forward norm takes an output without a separate bias")
            return self.post_norm(output), None

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            """megatron's MLP asks each child for its own sharded state dict; the norm (a torch
            module, replicated) goes through megatron's default."""
            from megatron.core import parallel_state
            from megatron.core.transformer.utils import sharded_state_dict_default

            tp_group = getattr(self, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
            norm = self._modules.pop("post_norm")
            try:
                out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
            finally:
                self._modules["post_norm"] = norm
            out.update(sharded_state_dict_default(norm, f"{prefix}post_norm.", sharded_offsets, metadata,
                                                  tp_group=tp_group))
            return out

    return GemmaMLP


def sandwich_spec(block):
    """The decoder block spec `block` with Gemma's post-attention and post-MLP norms."""
    import copy

    block = copy.deepcopy(block)
    for spec in block.layer_specs:
        sub = spec.submodules
        sub.self_attention.module = gemma_attention(sub.self_attention.module)
        sub.mlp.module = gemma_mlp(sub.mlp.module)
    return block
