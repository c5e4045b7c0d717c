"""RoPE for packed rows in one pass: per-token positions, gathered frequencies, one rotation.

A packed micro-batch holds hundreds of sequences in one `thd` row, and RoPE restarts at 0 in
each. megatron's unfused `thd` RoPE (`rope_utils._apply_rotary_pos_emb_thd`) reads `cu_seqlens`
back to the host (a device synchronisation), splits the row and slices the frequency table per
sequence in Python, and concatenates the slices back - for q and for k, in every layer, forward
and recompute. Here the row's positions come from `cu_seqlens` in one
shot (token index minus the start of its sequence), the frequencies are gathered per token
from megatron's own RoPE table (the model's inverse frequencies, so any scaling the model has
is kept), and q and k are each rotated by one elementwise expression over the whole row.

`PackedRopeSelfAttention` is megatron's `SelfAttention` with that rotation for packed rows: it
applies RoPE to q and k where megatron does (after the QK-norms of Qwen3, before core attention)
and hands megatron no `rotary_pos_emb`, so megatron's per-sequence path never runs. The
per-token cos/sin are built once per micro-batch (by the first layer that sees its
`PackedSeqParams`) and shared by every layer, which also means one saved copy for backward
instead of one per layer. Rows without `PackedSeqParams` take megatron's batched (`bshd`) RoPE,
already one pass. Heads are untouched, so tensor parallelism (heads split over ranks) needs
nothing; every pipeline stage builds its own tables.

Under context parallelism (`mrl.models.context_parallel`) a rank's row holds chunks from the
front and back of each sequence; their positions come from the micro-batch's CP layout.

Transformer Engine's layer spec is left alone: with `apply_rope_fusion` megatron calls TE's fused
`thd` RoPE kernel, one launch for the whole row.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.transformer.attention import SelfAttention

#: the attribute of a `PackedSeqParams` that holds its per-token cos/sin, per RoPE table and dtype
_CACHE_ATTR = "_mrl_packed_rope"


def packed_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Each token's position in its own sequence, `[total]` int64: `0..len-1` per sequence of the
    row described by `cu_seqlens` (`[n + 1]`, cumulative starts, `cu_seqlens[-1] == total`).
    Zero-length sequences are allowed. No host synchronisation (the output size is given)."""
    cu = cu_seqlens.to(torch.long)
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=total)
    return torch.arange(total, device=cu.device) - starts


def rope_tables(freqs: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token `(cos, sin_signed)`, each `[T, D]` in `dtype`, for `rotate`.

    `freqs` is megatron's RoPE table `[max_len, 1, 1, D]` (angles, non-interleaved: the two halves
    of the last dimension repeat the per-frequency angles). `sin_signed` is `sin` with its first
    half negated, so that `rotate_half(x) * sin == roll(x, D/2) * sin_signed`. cos and sin are
    rounded to `dtype` as megatron does before it multiplies.
    """
    angles = freqs.reshape(freqs.shape[0], freqs.shape[-1]).index_select(0, positions.to(freqs.device))
    cos = torch.cos(angles).to(dtype)
    sin = torch.sin(angles)
    half = sin.shape[-1] // 2
    sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(dtype)
    return cos, sin_signed


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE (`rotate_half` convention, as megatron and Hugging Face Llama/Qwen) on `x` `[T, ..., D]`
    with per-token tables `[T, D]`: `x * cos + rotate_half(x) * sin`, the same roundings as
    megatron's unfused RoPE (no fused multiply-add), so the two agree bit for bit."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    cos, sin_signed = cos.view(shape), sin_signed.view(shape)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def packed_rope_tables(packed_seq_params: Any, freqs: torch.Tensor, total: int, dtype: torch.dtype,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_tables` for the row `packed_seq_params` describes, built once per micro-batch.

    The result is kept on the `PackedSeqParams` object itself (it lives exactly as long as the
    micro-batch), keyed by the RoPE table's memory (activation recompute hands each layer a
    detached view of the same table), dtype and inference mode, so every layer of every forward
    and recompute over the same row reuses it.
    """
    cu = (packed_seq_params.cu_seqlens_q_padded if packed_seq_params.cu_seqlens_q_padded is not None
          else packed_seq_params.cu_seqlens_q)
    cache = packed_seq_params.__dict__.setdefault(_CACHE_ATTR, {})
    key = (freqs.data_ptr(), freqs.device, tuple(freqs.shape), freqs.stride(), freqs.dtype, dtype,
           torch.is_inference_mode_enabled())
    hit = cache.get(key)
    if hit is not None:
        return hit[1]
    cp = getattr(packed_seq_params, "mrl_cp", None)   # context parallelism: positions of this rank's chunks
    positions = cp.positions.to(freqs.device) if cp is not None else packed_positions(cu.to(freqs.device), total)
    tables = rope_tables(freqs, positions, dtype)
    cache[key] = (freqs, tables)   # holding `freqs` keeps its memory from being reused while cached
    return tables


def per_sequence_rope_reference(x: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """megatron's unfused per-sequence `thd` RoPE on `x` `[T, H, D]` (the path `PackedRopeSelfAttention`
    replaces), for equivalence tests and the benchmark."""
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False)
    one_rank = SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    return apply_rotary_pos_emb(x, freqs, config=config, cu_seqlens=cu_seqlens, cp_group=one_rank)


class PackedRopeSelfAttention(SelfAttention):
    """megatron's `SelfAttention`; for packed (`thd`) rows RoPE is `rotate` with per-token tables
    instead of megatron's per-sequence loop (see the module docstring)."""

    #: (PackedSeqParams, RoPE table) while `forward` runs on a packed row, for `get_query_key_value_tensors`
    _packed_rope: Optional[tuple[Any, torch.Tensor]] = None

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, packed_seq_params=None,
                **kwargs):
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        no_rope = bool(self.config.no_rope_freq and self.config.no_rope_freq[self.layer_number - 1])
        if not thd or rotary_pos_emb is None or no_rope or self.config.apply_rope_fusion:
            return super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb,
                                   packed_seq_params=packed_seq_params, **kwargs)
        if self.config.context_parallel_size > 1 and getattr(packed_seq_params, "mrl_cp", None) is None:
            raise ValueError("packed RoPE under context parallelism needs the CP layout of mrl.engine.packing.pack")
        if self.config.rotary_interleaved:
            raise ValueError("packed RoPE takes the rotate_half convention (rotary_interleaved = False)")
        freqs = rotary_pos_emb[0] if isinstance(rotary_pos_emb, tuple) else rotary_pos_emb
        if isinstance(rotary_pos_emb, tuple) and rotary_pos_emb[1].data_ptr() != freqs.data_ptr():
            raise ValueError("self-attention takes one RoPE table for q and k")
        if freqs.shape[-1] != self.hidden_size_per_attention_head:
            raise ValueError(f"packed RoPE rotates whole heads: RoPE table of width {freqs.shape[-1]} for "
                             f"head dim {self.hidden_size_per_attention_head} (rotary_percent < 1)")
        self._packed_rope = (packed_seq_params, freqs)
        try:
            return super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=None,
                                   packed_seq_params=packed_seq_params, **kwargs)
        finally:
            self._packed_rope = None

    def get_query_key_value_tensors(self, *args, **kwargs):
        out = super().get_query_key_value_tensors(*args, **kwargs)
        if self._packed_rope is None:
            return out
        packed_seq_params, freqs = self._packed_rope
        query, key, *rest = out   # [T, 1, H, D]: the whole row (gathered under sequence parallelism)
        cos, sin_signed = packed_rope_tables(packed_seq_params, freqs, query.shape[0], query.dtype)
        return (rotate(query, cos, sin_signed), rotate(key, cos, sin_signed), *rest)
