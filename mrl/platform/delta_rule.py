"""The gated delta rule (Gated DeltaNet's recurrence) over packed sequences, on every device.

For each sequence and each value head, with the state `S` (`[d_k, d_v]`, zeros at the
sequence's first token), per token `t`:

    S   <- S * exp(g_t)                           (gated decay; g_t <= 0)
    S   <- S + k_t (beta_t (v_t - S^T k_t))^T      (the delta rule: write v_t over what S recalls for k_t)
    o_t  = S^T q_t

with `q` and `k` L2-normalised (eps 1e-6 inside the square root, as `fla` and `transformers`
compute it) and `q` scaled by `d_k ** -0.5`; key heads serve `H_v / H_k` consecutive value heads.

Kernels (`gated_delta_rule` picks one by the tensors' device, as `mrl.weights.verify` picks its
Triton checksum):

- CUDA: `fla`'s chunked Triton kernel (`fla.ops.gated_delta_rule.chunk_gated_delta_rule`, the
  package `fla-core`, the `gpu` extra) with `cu_seqlens`, so the state resets at each packed
  sequence's start;
- CPU (and CUDA without `fla`): `recurrent_twin`, mrl's torch twin of that kernel, written from the
  recurrence above: every sequence of the row is one row of a padded batch (the padding has
  `g = beta = 0`, which leaves a state unchanged and is dropped), one vectorised step per token,
  everything in float32 and the output rounded once to the input dtype. Its arithmetic order is
  the recurrence's, not the chunked form's: it equals `transformers`' `torch_chunk_gated_delta_rule`
  to float32 rounding (tests/weights/test_gated_deltanet.py), not bit for bit. It steps token by
  token and autograd keeps every step's `[N, H_v, d_k, d_v]` state for the backward: memory and
  time linear in the tokens, fine for the tiny models CPU runs train, not a production kernel.

`megatron.core.ssm.gated_delta_net` imports the same `fla` kernel and has a torch fallback
(`torch_chunk_gated_delta_rule`, transformers' chunked form) but builds only on CUDA and takes no
packed sequences (`mrl.models.gated_deltanet` says why mrl has its own module).
"""
from __future__ import annotations

import functools

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(sum(x^2) + eps)` over the last dimension (fla's and transformers' l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_twin(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The gated delta rule by its recurrence (module docstring), in float32.

    q, k `[T, H_k, d_k]`, v `[T, H_v, d_v]`, g and beta `[T, H_v]` for one packed row whose
    sequences `cu_seqlens` (`[N + 1]`, from 0 to T) delimits; q and k not yet normalised.
    Returns `[T, H_v, d_v]` in v's dtype."""
    dtype = v.dtype
    total, hv = v.shape[0], v.shape[1]
    rep = hv // k.shape[1]
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    q = l2norm(q) / q.shape[-1] ** 0.5
    k = l2norm(k)
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    cu = [int(c) for c in cu_seqlens.tolist()]
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    n, longest = len(lengths), max(lengths, default=0)
    if total == 0 or longest == 0:
        return torch.zeros_like(v).to(dtype)
    # token index of (sequence i, step t); padding points at token 0 with g = beta = 0
    steps = torch.arange(longest)
    starts = torch.tensor(cu[:-1])
    valid = steps[None, :] < torch.tensor(lengths)[:, None]                         # [N, L]
    index = torch.where(valid, starts[:, None] + steps[None, :], torch.zeros_like(valid, dtype=torch.long))
    index = index.to(v.device)
    valid = valid.to(v.device)

    def padded(x: torch.Tensor) -> torch.Tensor:                                     # [N, L, ...]
        out = x[index]
        mask = valid.view(n, longest, *([1] * (x.dim() - 1)))
        return out * mask

    qp, kp, vp, gp, bp = (padded(x) for x in (q, k, v, g, beta))
    state = torch.zeros(n, hv, q.shape[-1], v.shape[-1], dtype=torch.float32, device=v.device)
    outs = []
    for t in range(longest):
        state = state * gp[:, t].exp()[..., None, None]
        k_t = kp[:, t]
        recalled = (state * k_t[..., None]).sum(dim=-2)                             # S^T k_t  [N, H, d_v]
        delta = (vp[:, t] - recalled) * bp[:, t][..., None]
        state = state + k_t[..., None] * delta[..., None, :]
        outs.append((state * qp[:, t][..., None]).sum(dim=-2))
    out = torch.stack(outs, dim=1)                                                   # [N, L, H, d_v]
    flat = out[valid]                                                                # sequences in row order
    return flat.to(dtype)


@functools.lru_cache(maxsize=1)
def fla_kernel():
    """fla's chunked gated delta rule, or None where `fla` does not import."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def kernel_name(device: torch.device | str) -> str:
    """Which kernel `gated_delta_rule` runs for tensors on `device`: "fla" or "twin"."""
    return "fla" if torch.device(device).type == "cuda" and fla_kernel() is not None else "twin"


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The gated delta rule over one packed row (shapes as `recurrent_twin`), by `kernel_name`'s kernel."""
    if kernel_name(v.device) == "twin":
        return recurrent_twin(q, k, v, g, beta, cu_seqlens)
    rep = v.shape[1] // k.shape[1]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    out, _ = fla_kernel()(q[None].contiguous(), k[None].contiguous(), v[None].contiguous(), g[None].float(),
                          beta[None].contiguous(), initial_state=None, output_final_state=False,
                          cu_seqlens=cu_seqlens.to(torch.long), use_qk_l2norm_in_kernel=True)
    return out[0].to(v.dtype)
