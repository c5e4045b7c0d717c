"""Causal attention on CPU: torch's CPU flash kernel, computed in float32, rounded once.

One kernel for the `sdpa` backend with and without context parallelism, so the two round alike.
A query block `[rep, Hkv, C, D]` (the query heads of a KV group ride the batch dimension against
K/V expanded without a copy) attends to keys `[Hkv, P + C, D]`: the first P without a mask, the
last C causally (its own block). Without context parallelism P = 0 and the block is a whole
sequence; under it (`mrl.models.context_parallel`) a query chunk's P keys are the earlier chunks
of its sequence, a second flash call merged with the first by log-sum-exp (ring attention's
merge; its backward is each block's flash backward with the merged output and log-sum-exp).

Why float32 inside. torch's CPU flash kernel on bf16 inputs rounds the softmax probabilities to
bf16 before its P @ V product, normalised by the row maximum of the keys it sees: a split
softmax (two calls with their own maxima, two bf16 outputs merged and rounded again) rounds
differently from one call over the same keys, and K/V gradients summed over query chunks and CP
ranks in bf16 round once per sum. bf16 CP2 drifted from bf16 CP1 by more than CP1's own
packing-to-packing noise (tools/bench/cp_bf16_rounding.py attributes it: 31% of the outputs and
57% of dK differed). In float32 each block is exact to float32 rounding, the merge is float32,
and the output is rounded to the input dtype once, as are the gradients (summed over a KV
group's query heads and both blocks here, over chunks and ranks by the caller in float32):
CP2 and CP1 then differ only where float32 order flips a bf16 rounding (0.02% of the outputs,
0.15% of dK, one ulp), and both are nearer float64 attention than torch's bf16 kernel (output
rms 2.6e-4 against 3.2e-4, dK 4.9e-4 against 1.1e-3). Saved for the backward: q, K, V and the
output in the input dtype (as the bf16 kernel saves them) and the float32 log-sum-exp; the
float32 copies live only inside one call. Measured cost: fwd+bwd of 8 heads x 4096 tokens x 64,
1.82 s in float32 against 1.60 s in bf16 on this CPU; the peak memory of a bf16 16k-token step
(tools/bench/cp_memory.py --dtype bfloat16) rose 3-5% (CP1 709 -> 727-738 MB, CP2 378-389 ->
399-404 MB: under CP each query chunk keeps its own bf16 copy of its key prefix).

The kernel needs equal query/key and value head sizes; `mrl.models.attention.sdpa_packed`
keeps torch's SDPA for the others (multi-latent attention).
"""
from __future__ import annotations

import torch

__all__ = ["BlockCausal", "block_causal", "grouped", "ungrouped"]


def _flash(q, k, v, causal: bool, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _flash_backward(grad, q, k, v, out, lse, causal: bool, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, causal,
                                                                               scale=scale)


def _expand(x: torch.Tensor, rep: int) -> torch.Tensor:
    """`[Hkv, L, D]` -> float32 `[rep, Hkv, L, D]` (stride 0 over `rep`: no copy per query head)."""
    return x.float().unsqueeze(0).expand(rep, -1, -1, -1)


class BlockCausal(torch.autograd.Function):
    """Query block `q` `[rep, Hkv, C, D]` attending to `k`/`v` `[Hkv, P + C, D]`: the first P keys
    unmasked, the last C causally (bottom-right), in float32; the output `[rep, Hkv, C, D]` in
    q's dtype. The K/V gradients come back in K/V's dtype (float32 K/V accumulate in float32)."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        rep, c = q.shape[0], q.shape[2]
        prefix = k.shape[1] - c
        qf, kf, vf = q.float(), _expand(k, rep), _expand(v, rep)
        out, lse = _flash(qf, kf[:, :, prefix:], vf[:, :, prefix:], True, scale)
        if prefix > 0:
            o0, lse0 = _flash(qf, kf[:, :, :prefix], vf[:, :, :prefix], False, scale)
            merged = torch.logaddexp(lse, lse0)
            out = out * torch.exp(lse - merged).unsqueeze(-1) + o0 * torch.exp(lse0 - merged).unsqueeze(-1)
            lse = merged
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k.to(q.dtype), v.to(q.dtype), out, lse)
        ctx.scale, ctx.prefix, ctx.kv_dtype = scale, prefix, k.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        p, scale, rep = ctx.prefix, ctx.scale, q.shape[0]
        qf, kf, vf, of, gf = q.float(), _expand(k, rep), _expand(v, rep), out.float(), grad.float().contiguous()
        dq, dk, dv = _flash_backward(gf, qf, kf[:, :, p:], vf[:, :, p:], of, lse, True, scale)
        if p > 0:
            dq0, dk0, dv0 = _flash_backward(gf, qf, kf[:, :, :p], vf[:, :, :p], of, lse, False, scale)
            dq, dk, dv = dq + dq0, torch.cat([dk0, dk], 2), torch.cat([dv0, dv], 2)
        return dq.to(q.dtype), dk.sum(0).to(ctx.kv_dtype), dv.sum(0).to(ctx.kv_dtype), None


def grouped(q: torch.Tensor, rep: int) -> torch.Tensor:
    """Query rows `[C, Hkv * rep, D]` -> `[rep, Hkv, C, D]`: the query heads of a KV group (megatron's
    GQA order: head h reads KV head h // rep) go to the batch dimension."""
    c, h, d = q.shape
    return q.view(c, h // rep, rep, d).permute(2, 1, 0, 3)


def ungrouped(o: torch.Tensor) -> torch.Tensor:
    """`[rep, Hkv, C, D]` -> `[C, Hkv * rep, D]` (`grouped`'s inverse)."""
    rep, hkv, c, d = o.shape
    return o.permute(2, 1, 0, 3).reshape(c, hkv * rep, d)


def block_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Query rows `[C, Hq, D]` of one sequence against its keys `[P + C, Hkv, D]` (the last C are
    the queries' own: causal among them) -> `[C, Hq, D]` in q's dtype."""
    rep = q.shape[1] // k.shape[1]
    return ungrouped(BlockCausal.apply(grouped(q, rep), k.transpose(0, 1), v.transpose(0, 1), scale))
