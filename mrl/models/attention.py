"""The attention seam: which kernel computes core attention, and the layer spec that uses it.

One place decides (`resolve_backend`, from `model.attention`), one module computes
(`PackedCoreAttention`), and `layer_specs` puts it into megatron's layer spec. Every backend
takes the packed `thd` layout: the micro-batch is one row of concatenated sequences described by
`cu_seqlens` (megatron's `PackedSeqParams`), RoPE restarts at 0 in every sequence, and attention
never crosses a sequence boundary. RoPE over the row is one vectorised rotation of q and of k
(`mrl.models.rope.PackedRopeSelfAttention`; Transformer Engine's fused kernel under `te`), not
megatron's per-sequence loop. No backend builds a `[T, T]` mask, so memory grows with the
longest sequence, not with the packed row.

Backends (`model.attention`):

- `te`: Transformer Engine's layer spec (fused attention, RoPE and norms, thd natively). CUDA
  only, when `transformer_engine` imports.
- `varlen`: torch's flash attention for packed sequences (`torch.nn.attention.varlen`); CUDA only.
  torch releases without its `enable_gqa` argument get K/V heads repeated per query group.
- `sdpa`: causal attention per sequence, torch's CPU flash kernel computed in float32 and rounded
  once (`mrl.models.flash_cpu`: O(L) memory per sequence of length L; the kernel context
  parallelism runs, so bf16 rounds alike at every CP size). The CPU default.
- `flex`: `flex_attention` over the packed row with a document-causal block mask (compiled on
  first use; block-sparse, so also linear in the row). CUDA only: torch's flex attention has no
  backward on CPU.
- `auto`: `te` if importable on CUDA, else `varlen` on CUDA, else `sdpa`.

Context parallelism (`parallel.context > 1`, `mrl.models.context_parallel`): `sdpa` (CPU) and
`varlen` (CUDA) all-gather K/V over the CP group and attend locally; `auto` picks `varlen` on
CUDA; `te` and `flex` are refused (mrl's CP layout is its own, not Transformer Engine's).

Measured (the reasons for `auto`): packed causal attention, 16 sequences / 19k tokens, 16 heads
(4 KV), head dim 64, bf16, fwd+bwd on one H100: `varlen` 1.37 ms, compiled `flex` 2.08 ms, a
per-sequence SDPA loop 7.1 ms. On CPU, `sdpa` runs torch's flash kernel per sequence (memory
linear in the sequence: 7 MB at 2 x 1024 tokens, 28 MB at 2 x 4096, fwd+bwd, 4 heads of 32).

Without Transformer Engine the norms are `RMSNorm`s built in the model's dtype, so norm weights
and activations share it (megatron's torch norm is built in fp32 whatever the model dtype; a bf16
model then casts at every norm and mixes dtypes in the distributed optimizer's buffers). fp32
master weights live in the optimizer, as megatron intends.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import inspect
import math
from typing import Literal, Optional

import torch

from mrl.errors import UserError

Backend = Literal["auto", "te", "varlen", "sdpa", "flex"]
BACKENDS: tuple[str, ...] = ("auto", "te", "varlen", "sdpa", "flex")
#: megatron's own unfused attention with an explicit dense mask: the reference the tests compare
#: the backends against. Never chosen by `auto`, not a spec value.
REFERENCE = "reference"


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def resolve_backend(requested: str, device: str, context: int = 1) -> str:
    """The concrete backend for `model.attention = requested` on `device` ("cpu" | "cuda") with
    `context` context-parallel ranks.

    A backend the device cannot run is a `UserError` naming the key (`mrl validate` calls this).
    """
    if requested == REFERENCE:
        return REFERENCE
    if context > 1:
        if requested in ("te", "flex"):
            raise UserError(f"model.attention: {requested!r} does not take parallel.context = {context}; "
                            "use 'auto' (sdpa on cpu, varlen on cuda)")
        if requested == "sdpa" and device == "cuda":
            raise UserError(f"model.attention: 'sdpa' with parallel.context = {context} runs on CPU only "
                            "(torch's CPU flash kernel); use 'varlen' or 'auto' on cuda")
        if requested == "auto":
            return "varlen" if device == "cuda" else "sdpa"
    if requested not in BACKENDS:
        raise UserError(f"model.attention: unknown backend {requested!r} (one of {', '.join(BACKENDS)})")
    if requested == "auto":
        if device == "cuda":
            return "te" if te_available() else "varlen"
        return "sdpa"
    if requested == "te" and (device != "cuda" or not te_available()):
        raise UserError("model.attention: 'te' needs platform.device = 'cuda' and Transformer Engine installed "
                        "(pip install mrl[gpu]); use 'auto'")
    if requested in ("varlen", "flex") and device != "cuda":
        raise UserError(f"model.attention: {requested!r} runs on CUDA only (torch has no CPU "
                        f"{'kernel' if requested == 'varlen' else 'backward'} for it); on cpu use 'sdpa' (or 'auto')")
    return requested


# --------------------------------------------------------------------------------- kernels

def sdpa_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                scale: float, window: Optional[int] = None, blocks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of each packed sequence on its own: q `[T, Hq, D]`, k/v `[T, Hkv, D]`
    -> `[T, Hq, D]`. torch's CPU flash kernel in float32, rounded once (`mrl.models.flash_cpu`:
    the kernel context parallelism runs, so bf16 rounds alike at every CP size); torch's SDPA
    where value heads differ in size from query/key heads (multi-latent attention), or off CPU.
    `split`/`cat` cut and join the row (their backward is one copy each; slicing or index-put
    would cost a full-row buffer per sequence in the backward). `window`: keys limited to the
    `window` before each query, by SDPA with a boolean `[L, L]` mask per sequence (no flash kernel;
    on CPU in float32, rounded once, as the flash path and the hf engine's CPU attention).
    `blocks` (`[T]`, Gemma 3's images, `mrl.models.gemma3_vlm.image_blocks`): a sequence holding
    image tokens takes SDPA with `gemma3_vlm.block_mask` (each image's tokens see each other both
    ways; the window still applies)."""
    from mrl.models.flash_cpu import block_causal
    from mrl.models.gemma3_vlm import block_mask
    from mrl.models.sink_attention import causal_window_mask

    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    flash = q.device.type == "cpu" and q.shape[-1] == v.shape[-1] and window is None
    gqa = q.shape[1] != k.shape[1]
    per_seq = torch.split(blocks.to(q.device), lengths) if blocks is not None else [None] * len(lengths)
    outs = []
    for qs, ks, vs, bs in zip(*(torch.split(x, lengths) for x in (q, k, v)), per_seq):
        if qs.shape[0] == 0:
            outs.append(qs)
            continue
        images = bs is not None and bool((bs >= 0).any())
        if flash and not images:
            outs.append(block_causal(qs, ks, vs, scale))
            continue
        if images:
            mask = block_mask(bs, window)
        else:
            mask = None if window is None else causal_window_mask(qs.shape[0], window, qs.device)
        # a masked sequence on CPU computes in float32 and rounds once, as the flash path and the hf engine
        wide = mask is not None and qs.device.type == "cpu" and qs.dtype in (torch.bfloat16, torch.float16)
        o = torch.nn.functional.scaled_dot_product_attention(
            *(x.float() if wide else x for x in (qs.transpose(0, 1).unsqueeze(0), ks.transpose(0, 1).unsqueeze(0),
                                                 vs.transpose(0, 1).unsqueeze(0))),
            attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa)
        outs.append(o.squeeze(0).transpose(0, 1).to(qs.dtype))
    return torch.cat(outs)


@functools.lru_cache(maxsize=1)
def _varlen_has_gqa() -> bool:
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def varlen_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                  max_seqlen: int, scale: float, window: Optional[int] = None) -> torch.Tensor:
    """torch's packed flash attention, causal (`window_size=(-1, 0)`), or over the `window` keys
    before each query (`(window, 0)`)."""
    from torch.nn.attention.varlen import varlen_attn

    cu = cu_seqlens.to(torch.int32)
    kwargs = dict(scale=scale, window_size=(-1 if window is None else window, 0))
    if q.shape[1] != k.shape[1]:
        if _varlen_has_gqa():
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def flex_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                scale: float) -> torch.Tensor:
    """`flex_attention` over the whole row with a document-causal block mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    total = q.shape[0]
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long)
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=q.device), lengths.to(q.device))

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    mask = create_block_mask(document_causal, None, None, total, total, device=q.device)
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))           # [1, H, T, D]
    o = _compiled_flex()(qs, ks, vs, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return o.squeeze(0).transpose(0, 1)


# --------------------------------------------------------------------------------- module

class PackedCoreAttention(torch.nn.Module):
    """megatron's `core_attention` submodule, computed by one of mrl's backends.

    Layers with attention sinks (`softmax_type = "learnable"`: gpt-oss) take
    `sink_attention.eager_packed`; a sliding window (`config.window_size` where
    `window_attn_skip_freq` says so) without sinks is `varlen`'s own window on CUDA and SDPA with a
    window mask under `sdpa` (`flex` takes the twin).

    Takes megatron's core-attention call: with `packed_seq_params` (thd) q `[T, Hq, D]` and k/v
    `[T, Hkv, D]` (this TP rank's heads), returning `[T, Hq * D]`; without it, q/k/v
    `[S, B, H, D]` are B independent causal sequences of length S (`[S, B, Hq * D]` out). A
    dense `attention_mask` is refused: these backends are causal per sequence by construction.
    """

    backend: str = "sdpa"

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 k_channels: Optional[int] = None, v_channels: Optional[int] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) > 0:
            raise UserError("attention dropout is not supported by mrl's packed attention (RL post-training "
                            "runs without dropout)")
        self.scale = softmax_scale if softmax_scale is not None else (
            config.softmax_scale if config.softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels))
        from megatron.core.transformer.utils import is_layer_window_attention

        # gpt-oss: this layer's window (megatron's window_size[0]) and the heads' learned sinks
        self.window = (config.window_size[0] if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number) else None)
        if config.softmax_type == "learnable":
            from megatron.core import parallel_state as ps
            from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

            tp = (pg_collection.tp.size() if pg_collection is not None
                  else ps.get_tensor_model_parallel_world_size())
            # Transformer Engine's name (core_attention.softmax_offset), this rank's heads; zeros
            # at every TP size (the checkpoint's sinks are loaded over them)
            self.softmax_offset = torch.nn.Parameter(
                torch.zeros(config.num_attention_heads // tp, dtype=config.params_dtype))
            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
        elif config.softmax_type != "vanilla":
            raise ValueError(f"mrl's packed attention has no softmax_type {config.softmax_type!r}")
        else:
            self.softmax_offset = None

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by mrl's packed attention")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            if attention_mask is not None:
                raise ValueError("packed (thd) attention takes no attention_mask: sequences come from cu_seqlens")
            cp = getattr(packed_seq_params, "mrl_cp", None)
            if cp is not None and (self.window is not None or self.softmax_offset is not None):
                raise ValueError("context parallelism takes no sliding window or attention sinks")
            if cp is not None:   # context parallelism: K/V all-gathered, local chunks attend (context_parallel)
                from mrl.models import context_parallel

                out = context_parallel.attention(query, key, value, cp, self.scale, self.backend)
                return out.reshape(out.shape[0], -1)
            cu = (packed_seq_params.cu_seqlens_q_padded if packed_seq_params.cu_seqlens_q_padded is not None
                  else packed_seq_params.cu_seqlens_q)
            blocks = getattr(packed_seq_params, "mrl_image_blocks", None)
            out = self._packed(query, key, value, cu, int(packed_seq_params.max_seqlen_q), blocks)
            return out.reshape(out.shape[0], -1)
        if self.config.context_parallel_size > 1:
            raise ValueError("context parallelism needs packed rows (mrl.engine.packing.pack)")
        if attention_mask is not None:
            raise ValueError("mrl's attention is causal per sequence and takes no dense attention_mask; pass "
                             "attention_mask=None (unpacked rows) or PackedSeqParams (packed rows)")
        s, b = query.shape[:2]
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=query.device)
        flat = [x.transpose(0, 1).reshape(b * s, *x.shape[2:]) for x in (query, key, value)]
        out = self._packed(*flat, cu, s)                                          # [B*S, H, D]
        return out.reshape(b, s, -1).transpose(0, 1).contiguous()

    def _packed(self, q, k, v, cu, max_seqlen, blocks=None):
        if blocks is not None:   # Gemma 3's images (bidirectional blocks): sdpa only (`mrl.models.megatron.model_backend`)
            if self.backend != "sdpa" or self.softmax_offset is not None:
                raise ValueError(f"bidirectional image blocks run under the sdpa backend only, not {self.backend!r}")
            return sdpa_packed(q, k, v, cu, self.scale, self.window, blocks)
        if self.softmax_offset is not None or (self.window is not None and self.backend == "flex"):
            from mrl.models.sink_attention import eager_packed

            return eager_packed(q, k, v, cu, self.scale, self.window, self.softmax_offset)
        if self.backend == "varlen":
            return varlen_packed(q, k, v, cu, max_seqlen, self.scale, self.window)
        if self.backend == "flex":
            return flex_packed(q, k, v, cu, self.scale)
        return sdpa_packed(q, k, v, cu, self.scale, self.window)


@functools.lru_cache(maxsize=None)
def core_attention_class(backend: str) -> type:
    """`PackedCoreAttention` bound to one backend (a class, as megatron's spec wants)."""
    return type(f"PackedCoreAttention_{backend}", (PackedCoreAttention,), {"backend": backend})


class RMSNorm(torch.nn.RMSNorm):
    """megatron's norm call signature, built in the model's dtype.

    Under sequence parallelism the weight is marked `sequence_parallel`, so megatron all-reduces
    its gradient over the tensor-parallel group (each rank sees a slice of the sequence).
    With megatron's `layernorm_zero_centered_gamma` (Gemma's norms) the weight is stored as `w`
    (zeros at init) and scales by `1 + w`, computed in float32 and cast back, as `Gemma3RMSNorm`.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        if config.normalization != "RMSNorm":
            raise ValueError("mrl's norm is RMSNorm")
        # built on the host like megatron's own torch norm; the model is moved to its device whole
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.zero_centered = bool(zero_centered_gamma or config.layernorm_zero_centered_gamma)
        if self.zero_centered:
            torch.nn.init.zeros_(self.weight)
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.zero_centered:
            return super().forward(x)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


# --------------------------------------------------------------------------------- layer spec

def layer_specs(config, backend: str, *, vp_stage: Optional[int] = None):
    """megatron's decoder block spec for this pipeline stage with mrl's attention and norms.

    `te` keeps Transformer Engine's spec untouched (its fused `thd` RoPE included); every other
    backend takes the local spec, swaps `core_attention` for `PackedCoreAttention` and
    `SelfAttention` for `PackedRopeSelfAttention` (RoPE over a packed row in one pass,
    `mrl.models.rope`), or keeps megatron's own attention for `reference`, and every norm for
    `RMSNorm` in the model's dtype.
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if backend == "te":
        return specs.get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm",
                                                vp_stage=vp_stage)
    mla = bool(getattr(config, "multi_latent_attention", False))
    if mla and config.context_parallel_size > 1:
        raise UserError("parallel.context > 1 does not take multi-latent attention (DeepSeek-V3) yet: its RoPE is "
                        "megatron's per-sequence one, which knows no mrl CP layout")
    if mla:   # megatron's local MLA spec asks its backend for a `linear()` the local backend lacks:
        config = copy.copy(config)   # build the plain local spec, then put MLA in (`_mla_attention`)
        config.multi_latent_attention = False
    block = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                             vp_stage=vp_stage)
    attention = None if backend == REFERENCE else core_attention_class(backend)
    layers = [_own_layer(spec, attention, mla=mla, expert_bias=config.add_bias_linear) for spec in block.layer_specs]
    return dataclasses.replace(block, layer_specs=layers, layer_norm=RMSNorm)


def _mla_attention(attention):
    """Multi-latent attention (DeepSeek-V3) from local modules: the down projections are column-
    parallel (megatron gathers their output over TP before the norms), the up projections column-
    parallel by heads, the latent norms `RMSNorm`s in the model dtype, RoPE megatron's own (per
    sequence on packed rows; MLA rotates only the `qk_pos_emb_head_dim` part), core attention mrl's
    backend (q/k head dim != v head dim is fine for every backend)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=MLASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                      submodules=MLASelfAttentionSubmodules(
                          linear_q_proj=ColumnParallelLinear, linear_q_down_proj=ColumnParallelLinear,
                          linear_q_up_proj=ColumnParallelLinear, linear_kv_down_proj=ColumnParallelLinear,
                          linear_kv_up_proj=ColumnParallelLinear, core_attention=attention or DotProductAttention,
                          linear_proj=RowParallelLinear, q_layernorm=RMSNorm, kv_layernorm=RMSNorm))


@functools.lru_cache(maxsize=1)
def _expert_fc2_class() -> type:
    """megatron's `RowParallelLinear` returning an output of its own for experts with biases.

    megatron-core 0.16.1's `MLP.forward` adds an expert's scaled `linear_fc2` bias in place to the
    layer's output, which at expert-tensor size 1 is the input of `reduce_from_tensor_model_parallel_region`
    returned as is by a custom autograd function: autograd refuses that in-place write in training
    (gpt-oss, `SequentialMLP`; Transformer Engine's grouped experts add it elsewhere). One copy of
    the expert's output makes it writable."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    class ExpertRowParallelLinear(RowParallelLinear):
        def forward(self, *args, **kwargs):
            output, bias = super().forward(*args, **kwargs)
            return (output.clone() if bias is not None else output), bias

    return ExpertRowParallelLinear


def _own_layer(spec, attention, *, mla: bool = False, expert_bias: bool = False):
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.identity_op import IdentityOp

    from mrl.models import rope

    spec = copy.deepcopy(spec)
    sub = spec.submodules
    sub.input_layernorm = RMSNorm
    sub.pre_mlp_layernorm = RMSNorm
    experts = getattr(getattr(getattr(sub.mlp, "submodules", None), "experts", None), "submodules", None)
    if expert_bias and getattr(experts, "linear_fc2", None) is RowParallelLinear:
        experts.linear_fc2 = _expert_fc2_class()
    if mla:
        sub.self_attention = _mla_attention(attention)
        return spec
    attn = sub.self_attention.submodules
    if attention is not None:
        if sub.self_attention.module is not SelfAttention:
            raise ValueError(f"megatron's local layer spec has {sub.self_attention.module.__name__}, "
                             "not SelfAttention: mrl's packed RoPE does not know it")
        sub.self_attention.module = rope.PackedRopeSelfAttention
        attn.core_attention = attention
    if attn.q_layernorm is not IdentityOp:
        attn.q_layernorm = RMSNorm
    if attn.k_layernorm is not IdentityOp:
        attn.k_layernorm = RMSNorm
    return spec
