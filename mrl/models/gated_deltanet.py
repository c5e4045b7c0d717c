"""Qwen3-Next and Qwen3.5 hybrids (`qwen3_next`, `qwen3_5_text`, `qwen3_5_moe_text`) from megatron pieces.

What `transformers` computes, and how mrl builds it:

- layers per `layer_types`: `"linear_attention"` is a Gated DeltaNet (`GatedDeltaNet` below),
  `"full_attention"` megatron's `SelfAttention` with its output gate (`attention_output_gate`: q_proj
  emits each head's query and gate, the attention output is multiplied by `sigmoid(gate)` before
  o_proj), QK-norm and partial RoPE (`partial_rotary_factor`, 0.25 in the published models);
- every RMSNorm scales by `(1 + w)` in float32 (megatron's `layernorm_zero_centered_gamma`, mrl's
  `RMSNorm`), except the DeltaNet's gated output norm (`GatedRMSNorm`: `w`, then `silu(z)`);
- `qwen3_next` / `qwen3_5_moe_text`: routed experts (softmax, top-k renormalised) plus Qwen2-MoE's
  shared expert scaled by `sigmoid(shared_expert_gate(x))`; `qwen3_5_text`: a dense SwiGLU MLP;
- Qwen3.5's multimodal RoPE reduces to the plain table for text positions (its three position
  streams are equal), so its text models take the ordinary RoPE; the multimodal `qwen3_5` /
  `qwen3_5_moe` take interleaved mRoPE on the same partial-rotary dims (`mrl.models.vlm_gpt`).

Why not megatron-core 0.16.1's `megatron.core.ssm.gated_delta_net.GatedDeltaNet`: it allocates its
conv and gates with `torch.cuda.current_device()`, refuses to build without `fla`, and raises
`NotImplementedError` for packed sequences, which every mrl micro-batch is. `GatedDeltaNet` here
keeps its parameters and their TP layout (`in_proj` rows per TP rank `[q_r k_r v_r z_r b_r a_r]`,
`conv1d` channels `[q_r k_r v_r]`, `A_log` / `dt_bias` per value head, `out_norm`, `out_proj`) and
adds what mrl needs: the causal conv and the recurrence restart at every packed sequence's start
(`causal_conv_packed`, `mrl.platform.delta_rule`), so a packed row equals its sequences one by one.
Key heads (and their value heads) are split over tensor parallelism; context parallelism is refused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mrl.errors import UserError

from mrl.models.facts import HYBRID_TYPES, layer_kinds

LAYER_KINDS = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class DeltaNetDims:
    """A Gated DeltaNet layer's shape: key heads, value heads, their head dims, the conv kernel."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int = 4
    eps: float = 1e-6

    @classmethod
    def of(cls, hf: dict[str, Any]) -> "DeltaNetDims":
        return cls(int(hf["linear_num_key_heads"]), int(hf["linear_num_value_heads"]), int(hf["linear_key_head_dim"]),
                   int(hf["linear_value_head_dim"]), int(hf.get("linear_conv_kernel_dim") or 4),
                   float(hf.get("rms_norm_eps", 1e-6)))

    def sections(self, tp: int = 1) -> list[int]:
        """This TP rank's `in_proj` rows: q, k, v, z, b, a."""
        kh, vh = self.key_heads // tp, self.value_heads // tp
        return [kh * self.key_dim, kh * self.key_dim, vh * self.value_dim, vh * self.value_dim, vh, vh]


def hybrid_fields(hf: dict[str, Any], tensor_parallel: int = 1, context_parallel: int = 1) -> dict[str, Any]:
    """TransformerConfig fields for a Qwen3-Next / Qwen3.5 text config, or one-line refusals."""
    mt = hf["model_type"]
    kinds = layer_kinds(hf)
    unknown = sorted(set(kinds) - set(LAYER_KINDS))
    if unknown:
        raise UserError(f"model.path: {mt} layer_types {unknown} are not built (linear_attention, full_attention)")
    if len(kinds) != hf["num_hidden_layers"]:
        raise UserError(f"model.path: {mt} has {len(kinds)} layer_types for {hf['num_hidden_layers']} layers")
    if context_parallel > 1 and "linear_attention" in kinds:
        raise UserError(f"parallel.context: {mt}'s Gated DeltaNet layers are not built for context parallelism "
                        "(their recurrence runs over whole sequences); use parallel.context = 1")
    if hf.get("attention_bias"):
        raise UserError(f"model.path: {mt} with attention_bias is not supported (the published models have none)")
    dims = DeltaNetDims.of(hf)
    if dims.value_heads % dims.key_heads:
        raise UserError(f"model.path: linear_num_value_heads {dims.value_heads} is not a multiple of "
                        f"linear_num_key_heads {dims.key_heads}")
    if dims.key_heads % tensor_parallel:
        raise UserError(f"parallel.tensor: {tensor_parallel} does not divide {mt}'s linear_num_key_heads "
                        f"{dims.key_heads} (Gated DeltaNet heads are split over tensor parallelism)")
    # layers differ (DeltaNet or attention): checkpoints key each layer apart, not stacked by layer
    return dict(layernorm_zero_centered_gamma=True, qk_layernorm=True, attention_output_gate=True,
                hetereogenous_dist_checkpoint=True)


# ----------------------------------------------------------------------------- the module

class GatedRMSNorm(torch.nn.Module):
    """The DeltaNet's output norm per value head (`Qwen3NextRMSNormGated`): RMS-normalise in float32,
    round to the input dtype, scale by `w` (ones at init, not zero-centred), times `silu(z)` in
    float32, rounded once. Each TP rank holds other heads, so the weight's gradient is summed over
    the TP group (megatron's `copy_to_tensor_model_parallel_region` on the weight)."""

    def __init__(self, config, hidden: int, eps: float, tp_group):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden, dtype=config.params_dtype))
        self.eps, self.tp_group = eps, tp_group

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        weight = self.weight
        if self.tp_group is not None and self.tp_group.size() > 1 and torch.is_grad_enabled():
            weight = copy_to_tensor_model_parallel_region(weight, group=self.tp_group)
        dtype = x.dtype
        h = x.float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (weight * h * F.silu(gate.float())).to(dtype)


def causal_conv_packed(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv (kernel K) over a packed row `x` `[T, C]`, restarting at every
    sequence: token t sees tokens t-K+1..t of its own sequence (`positions[t]`, its index in its
    sequence, masks the rest), as `F.conv1d` with K-1 zeros of left padding on each sequence alone."""
    k = weight.shape[-1]
    w = weight.reshape(weight.shape[0], k)                       # [C, K]
    out = x * w[:, k - 1]
    for shift in range(1, k):
        shifted = F.pad(x, (0, 0, shift, 0))[: x.shape[0]]
        mask = (positions >= shift).to(x.dtype)[:, None]
        out = out + shifted * mask * w[:, k - 1 - shift]
    return out


def _row_layout(packed_seq_params, s: int, b: int, device) -> torch.Tensor:
    """The packed row's sequence boundaries (`cu_seqlens`, padded ones where given), or B
    sequences of length S for an unpacked `[S, B]` batch."""
    if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
        if b != 1:
            raise ValueError("a packed (thd) row has batch size 1")
        cu = (packed_seq_params.cu_seqlens_q_padded if packed_seq_params.cu_seqlens_q_padded is not None
              else packed_seq_params.cu_seqlens_q).to(device=device, dtype=torch.long)
        if int(cu[-1]) < s:   # a tail past the last sequence is one more (padding) sequence
            cu = torch.cat([cu, torch.tensor([s], device=device, dtype=torch.long)])
        return cu
    return torch.arange(0, (b + 1) * s, s, device=device, dtype=torch.long)


def _positions(cu: torch.Tensor, total: int) -> torch.Tensor:
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
    return torch.arange(total, device=cu.device) - starts[:total]


class GatedDeltaNet(torch.nn.Module):
    """Gated DeltaNet token mixer in megatron's self-attention slot (`[S, B, H]` in, `(out, bias)` out).

    `in_proj` (column-parallel, this rank's key heads and their value heads) -> q, k, v, z, b, a;
    causal depthwise conv + SiLU over q|k|v; `g = -exp(A_log) * softplus(a + dt_bias)` (float32),
    `beta = sigmoid(b)`; the gated delta rule (`mrl.platform.delta_rule`); `out_norm(o, z)`;
    `out_proj` (row-parallel)."""

    def __init__(self, config, submodules=None, layer_number: int | None = None, pg_collection=None,
                 dims: DeltaNetDims | None = None, cp_comm_type=None, **_):
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                          set_tensor_model_parallel_attributes)

        super().__init__()
        if config.context_parallel_size > 1:
            raise UserError("parallel.context: Gated DeltaNet layers are not built for context parallelism")
        self.config, self.layer_number, self.dims = config, layer_number, dims
        tp_group = getattr(pg_collection, "tp", None)
        if tp_group is None:
            tp_group = ps.get_tensor_model_parallel_group()
        tp, rank = tp_group.size(), tp_group.rank()
        self.tp = tp
        d = dims
        width = sum(d.sections(1))
        self.in_proj = ColumnParallelLinear(config.hidden_size, width, config=config, init_method=config.init_method,
                                            bias=False, gather_output=False, skip_bias_add=False,
                                            tp_comm_buffer_name="fc1", tp_group=tp_group)
        self.out_proj = RowParallelLinear(d.value_heads * d.value_dim, config.hidden_size, config=config,
                                          init_method=config.output_layer_init_method, bias=False,
                                          input_is_parallel=True, skip_bias_add=True, tp_comm_buffer_name="fc2",
                                          tp_group=tp_group)
        kh, vh = d.key_heads // tp, d.value_heads // tp
        if config.use_cpu_initialization and config.perform_initialization:
            # the whole [q | k | v | z | b | a] weight drawn on every rank, this rank's heads kept:
            # one seed gives the same model at any TP size, as megatron's own layers
            full = torch.empty(width, config.hidden_size)
            config.init_method(full)
            local = torch.cat([part.chunk(tp)[rank] for part in full.split(d.sections(1))])
            with torch.no_grad():
                self.in_proj.weight.copy_(local.to(self.in_proj.weight.dtype))
        conv_full = torch.empty(2 * d.key_heads * d.key_dim + d.value_heads * d.value_dim, 1, d.conv_kernel)
        torch.nn.init.uniform_(conv_full, -1 / math.sqrt(d.conv_kernel), 1 / math.sqrt(d.conv_kernel))
        q, k, v = conv_full.split([d.key_heads * d.key_dim, d.key_heads * d.key_dim, d.value_heads * d.value_dim])
        local = torch.cat([q.chunk(tp)[rank], k.chunk(tp)[rank], v.chunk(tp)[rank]])
        self.conv1d = torch.nn.Module()
        self.conv1d.weight = torch.nn.Parameter(local.to(config.params_dtype))
        a_full = torch.empty(d.value_heads).uniform_(1, 16).log()
        self.A_log = torch.nn.Parameter(a_full.chunk(tp)[rank].to(config.params_dtype))
        self.dt_bias = torch.nn.Parameter(torch.ones(vh, dtype=config.params_dtype))
        for p in (self.conv1d.weight, self.A_log, self.dt_bias):
            set_tensor_model_parallel_attributes(p, True, 0, 1)
        self.out_norm = GatedRMSNorm(config, d.value_dim, d.eps, tp_group)
        self._local = (kh, vh)

    def forward(self, hidden_states, attention_mask=None, *args, packed_seq_params=None, inference_context=None,
                **kwargs):
        from mrl.platform.delta_rule import gated_delta_rule

        if inference_context is not None:
            raise ValueError("Gated DeltaNet layers take no megatron inference context")
        d, (kh, vh) = self.dims, self._local
        proj, _ = self.in_proj(hidden_states)                               # [S, B, P/tp]
        s, b = proj.shape[:2]
        cu = _row_layout(packed_seq_params, s, b, proj.device)
        if packed_seq_params is None and attention_mask is not None:
            raise ValueError("Gated DeltaNet layers are causal per sequence and take no dense attention_mask")
        flat = proj.transpose(0, 1).reshape(b * s, -1)                      # sequences in row order
        q, k, v, z, beta, a = flat.split(d.sections(self.tp), dim=-1)
        qkv = torch.cat([q, k, v], dim=-1)
        qkv = F.silu(causal_conv_packed(qkv, self.conv1d.weight, _positions(cu, b * s)))
        q, k, v = qkv.split([kh * d.key_dim, kh * d.key_dim, vh * d.value_dim], dim=-1)
        total = b * s
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = gated_delta_rule(q.reshape(total, kh, d.key_dim), k.reshape(total, kh, d.key_dim),
                               v.reshape(total, vh, d.value_dim), g, beta.sigmoid(), cu)
        out = self.out_norm(out, z.reshape(total, vh, d.value_dim)).reshape(b, s, -1).transpose(0, 1)
        return self.out_proj(out.contiguous())

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """megatron's GatedDeltaNet checkpoint layout: `in_proj` and `conv1d` split into their named
        per-rank sections (so a checkpoint reshards across TP sizes), the per-head tensors TP-split."""
        from megatron.core.ssm.gated_delta_net import _split_tensor_factory
        from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group,
                                                     make_sharded_tensors_for_checkpoint,
                                                     sharded_state_dict_default)

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        tp_group = self.out_norm.tp_group
        out = make_sharded_tensors_for_checkpoint(
            {"A_log": self.A_log, "dt_bias": self.dt_bias}, prefix, {"A_log": 0, "dt_bias": 0}, sharded_offsets,
            tp_group=tp_group, dp_cp_group=metadata["dp_cp_group"])
        out.update(make_sharded_tensors_for_checkpoint(
            {"weight": self.conv1d.weight}, f"{prefix}conv1d.", {"weight": 0}, sharded_offsets,
            tp_group=tp_group, dp_cp_group=metadata["dp_cp_group"]))
        out.update(make_sharded_tensors_for_checkpoint(
            {"weight": self.out_norm.weight}, f"{prefix}out_norm.", {}, sharded_offsets,
            tp_group=tp_group, dp_cp_group=metadata["dp_cp_group"]))
        for name in ("in_proj", "out_proj"):
            out.update(sharded_state_dict_default(getattr(self, name), f"{prefix}{name}.", sharded_offsets, metadata,
                                                  tp_group=tp_group))
        d, (kh, vh) = self.dims, self._local
        out[f"{prefix}in_proj.weight"] = _split_tensor_factory(
            out[f"{prefix}in_proj.weight"], d.sections(self.tp), ["query", "key", "value", "z", "beta", "alpha"], 0)
        out[f"{prefix}conv1d.weight"] = _split_tensor_factory(
            out[f"{prefix}conv1d.weight"], [kh * d.key_dim, kh * d.key_dim, vh * d.value_dim],
            ["query", "key", "value"], 0)
        return out


def hybrid_spec(block, hf: dict[str, Any], config, vp_stage: int | None = None):
    """The decoder block spec `block` with a `GatedDeltaNet` in every `linear_attention` layer of
    this pipeline stage (the others keep megatron's gated self-attention)."""
    import copy

    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    block = copy.deepcopy(block)
    kinds = layer_kinds(hf)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    dims = DeltaNetDims.of(hf)
    for i, spec in enumerate(block.layer_specs):
        if kinds[offset + i] == "linear_attention":
            spec.submodules.self_attention = ModuleSpec(module=GatedDeltaNet, params={"dims": dims})
    return block
