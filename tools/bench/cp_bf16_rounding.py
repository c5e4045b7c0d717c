"""Where bf16 context-parallel attention rounds differently from one whole-sequence call (CPU).

    python tools/bench/cp_bf16_rounding.py [--heads 8 --kv-heads 2 --dim 64 --lengths 300,1000,77]

One process simulates every CP rank (K/V whole, as after the all-gather, which copies bytes and
rounds nothing). For each variant it prints, against CP1 (`mrl.models.attention.sdpa_packed`,
one flash call per sequence) in the same dtype: the fraction of attention outputs and of q/K/V
gradient elements that differ and the largest difference, and each one's root-mean-square
distance to float64 attention. Variants of CP2's kernel:

- `bf16-blocks`: the kernel before `mrl.models.flash_cpu` (a copy): the two flash blocks of a
  query chunk (earlier chunks, own chunk) in bf16, their bf16 outputs merged by log-sum-exp in
  float32 and rounded again, the backward each block's bf16 flash backward with the merged
  output and log-sum-exp; K/V gradients summed over chunks and ranks in bf16;
- `fp32-blocks, bf16 K/V sums`: blocks in float32, merged in float32, rounded once; the K/V
  gradients of the chunks and ranks still summed in bf16;
- `fp32 (mrl)`: `mrl.models.context_parallel._sdpa_cp` with K/V rows in float32 (the kernel and
  the gather mrl runs): the K/V gradients are summed in float32 and rounded once.

With `--old-cp1` CP1 is torch's bf16 SDPA (the `sdpa` backend before `flash_cpu`) instead.
Figures are printed, never asserted.
"""
from __future__ import annotations

import argparse

import torch

from mrl.models import context_parallel as CP
from mrl.models import flash_cpu
from mrl.models.attention import sdpa_packed


class _OldBlockCausal(torch.autograd.Function):
    """The kernel before flash_cpu: two bf16 flash blocks merged in float32 and rounded again;
    the backward is each block's bf16 flash backward with the merged output and log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        f = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        c = q.shape[2]
        p = k.shape[2] - c
        out, lse = f(q, k[:, :, p:], v[:, :, p:], 0.0, True, scale=scale)
        if p > 0:
            o0, lse0 = f(q, k[:, :, :p], v[:, :, :p], 0.0, False, scale=scale)
            m = torch.logaddexp(lse, lse0)
            out = (out.float() * torch.exp(lse - m).unsqueeze(-1) + o0.float() * torch.exp(lse0 - m).unsqueeze(-1)).to(q.dtype)
            lse = m
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.prefix = scale, p
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        p, scale = ctx.prefix, ctx.scale
        bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grad = grad.contiguous()
        dq, dk1, dv1 = bwd(grad, q, k[:, :, p:], v[:, :, p:], out, lse, 0.0, True, scale=scale)
        if p == 0:
            return dq, dk1, dv1, None
        dq0, dk0, dv0 = bwd(grad, q, k[:, :, :p], v[:, :, :p], out, lse, 0.0, False, scale=scale)
        return dq + dq0, torch.cat([dk0, dk1], 2), torch.cat([dv0, dv1], 2), None


def _old_block(q, k, v, scale):
    rep = q.shape[1] // k.shape[1]
    kg, vg = (x.transpose(0, 1).unsqueeze(0).expand(rep, -1, -1, -1) for x in (k, v))
    return flash_cpu.ungrouped(_OldBlockCausal.apply(flash_cpu.grouped(q, rep), kg, vg, scale))


def _cp2(q, k, v, lengths, n, scale, g, variant):
    out = torch.zeros_like(q)
    dq = torch.zeros_like(q)
    acc = torch.float32 if variant == "fp32 (mrl)" else q.dtype
    dk, dv = torch.zeros(k.shape, dtype=acc), torch.zeros(v.shape, dtype=acc)
    for r in range(n):
        lay = CP.layout(lengths, n, r)
        qs = q.detach()[lay.index].requires_grad_()
        ks, vs = (x.detach().to(acc).requires_grad_() for x in (k, v))
        if variant == "fp32 (mrl)":
            o = CP._sdpa_cp(qs, ks, vs, lay, scale)
        else:
            block = _old_block if variant == "bf16-blocks" else flash_cpu.block_causal
            outs, start = [], 0
            for qq, kk, vv, length in zip(torch.split(qs, [2 * (m // (2 * n)) for m in lengths]),
                                          torch.split(ks, lengths), torch.split(vs, lengths), lengths):
                c = length // (2 * n)
                for half, j in zip(torch.split(qq, c), (r, 2 * n - 1 - r)):
                    outs.append(block(half, kk[:(j + 1) * c], vv[:(j + 1) * c], scale))
            o = torch.cat(outs)
        out[lay.index] = o.detach()
        a, b, c = torch.autograd.grad((o * g[lay.index]).sum(), (qs, ks, vs))
        dq[lay.index] = a
        dk += b   # the ranks' K/V gradients summed (the all-reduce) in `acc`
        dv += c
    return out, dq, dk.to(q.dtype), dv.to(q.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--lengths", default="300,1000,77")
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--old-cp1", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    n, dt, scale = args.cp, torch.bfloat16, args.dim ** -0.5
    lengths = [CP.padded_length(int(x), n) for x in args.lengths.split(",")]
    total = sum(lengths)
    q = torch.randn(total, args.heads, args.dim, dtype=dt, requires_grad=True)
    k = torch.randn(total, args.kv_heads, args.dim, dtype=dt, requires_grad=True)
    v = torch.randn(total, args.kv_heads, args.dim, dtype=dt, requires_grad=True)
    cu = torch.tensor([0] + lengths).cumsum(0)
    if args.old_cp1:
        rep = args.heads // args.kv_heads
        parts = [torch.nn.functional.scaled_dot_product_attention(
            qs.transpose(0, 1).unsqueeze(0), ks.repeat_interleave(rep, 1).transpose(0, 1).unsqueeze(0),
            vs.repeat_interleave(rep, 1).transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale).squeeze(0).transpose(0, 1)
            for qs, ks, vs in zip(*(torch.split(x, lengths) for x in (q, k, v)))]
        cp1 = torch.cat(parts)
    else:
        cp1 = sdpa_packed(q, k, v, cu, scale)
    g = torch.randn_like(cp1)
    want = [cp1.detach(), *torch.autograd.grad((cp1 * g).sum(), (q, k, v))]
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = CP.reference_attention(q64, k64, v64, lengths, scale)
    exact = [ref.detach(), *torch.autograd.grad((ref * g.double()).sum(), (q64, k64, v64))]
    rms = lambda a, b: ((a.double() - b) ** 2).mean().sqrt().item()   # noqa: E731
    print(f"lengths {lengths}, CP{n}, {args.heads} heads / {args.kv_heads} KV, dim {args.dim}, bf16; "
          f"CP1 = {'torch bf16 SDPA' if args.old_cp1 else 'mrl sdpa (flash_cpu)'}")
    print("CP1 rms to float64: " + ", ".join(f"{name} {rms(w, e):.3e}" for name, w, e in zip(("out", "dq", "dk", "dv"), want, exact)))
    for variant in ("bf16-blocks", "fp32-blocks, bf16 K/V sums", "fp32 (mrl)"):
        got = _cp2(q, k, v, lengths, n, scale, g, variant)
        cells = []
        for name, a, w, e in zip(("out", "dq", "dk", "dv"), got, want, exact):
            cells.append(f"{name}: {(a != w).float().mean().item():6.2%} differ, max {(a.float() - w.float()).abs().max().item():.2e}, "
                         f"rms to f64 {rms(a, e):.3e}")
        print(f"{variant:>28}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
