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
- CPU (and CUDA without `fla`): `chunked_twin`, mrl's torch twin of that kernel: the same chunked
  (WY / UT-transform) form, written from the recurrence above (its docstring derives it): per chunk
  of `CHUNK` = 64 tokens one triangular solve (`torch.linalg.solve_triangular`), batched over every
  chunk of the row, then one sequential step per chunk position carrying each sequence's state;
  everything in float32 and the output rounded once to the input dtype. Each sequence of the row
  is its own chunks (the last padded with `k = g = beta = 0`, which leaves the state unchanged and
  is dropped), so the state resets at every sequence and a packed row equals its sequences one by
  one. Cost: one Python step per chunk of the longest sequence (T / C at most); autograd keeps one
  `[H_v, d_k, d_v]` state per chunk plus O(T C H) intra-chunk values (tools/bench/delta_rule.py
  measures both: on a 2-core CPU 6-15x faster, 14x fewer saved bytes at d_k = d_v = 128).
- `recurrent_twin` is the recurrence read literally, one vectorised step per token over the row's
  sequences as a padded batch: the reference the chunked twin is tested against (to float32
  rounding, as is `transformers`' `torch_chunk_gated_delta_rule`: tests/weights/test_gated_deltanet.py).
  It is not run by the models: T Python steps, and autograd keeps every step's `[N, H_v, d_k, d_v]`
  state for the backward (memory O(T H d_k d_v)).

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
    """The gated delta rule by its recurrence (module docstring), in float32: the reference.

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


CHUNK = 64
"""Tokens per chunk of `chunked_twin`: fla's chunk (its kernels' `BT = 64`), so the CPU twin sums in
the blocks the CUDA kernel does. It balances the two costs the chunk size trades: per token, the
intra-chunk `[C, C]` matrices (a few times C floats, kept for the backward) grow with C, the carried
`[d_k, d_v]` state (one per chunk) shrinks with it (d_k d_v / C floats per token: 256 at 128 x 128)."""


def _chunk_layout(cu: list[int], chunk: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Where each token goes in `chunked_twin`'s chunk slots.

    The sequences are sorted longest first and their chunks laid out position-major: chunk 0 of
    every sequence, then chunk 1 of those with two or more, ... so the chunks at position i are
    one contiguous block and belong to the first `counts[i]` sorted sequences. Returns the token
    index of every slot `[chunks, C]` (padding points at token 0), its validity mask, and `counts`."""
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    n_chunks = [-(-lengths[i] // chunk) for i in order]
    counts = [sum(1 for n in n_chunks if n > i) for i in range(n_chunks[0] if n_chunks else 0)]
    starts = torch.tensor([cu[order[s]] + i * chunk for i, m in enumerate(counts) for s in range(m)], dtype=torch.long)
    ends = torch.tensor([cu[order[s] + 1] for i, m in enumerate(counts) for s in range(m)], dtype=torch.long)
    index = starts[:, None] + torch.arange(chunk)[None, :]
    valid = index < ends[:, None]
    return torch.where(valid, index, torch.zeros_like(index)), valid, counts


def chunked_twin(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 cu_seqlens: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The gated delta rule in its chunked (WY / UT-transform) form, in float32: `recurrent_twin`'s
    arguments, result and packed-row semantics, with one sequential step per C tokens of the row's
    longest sequence instead of one per token.

    Within a chunk of C tokens, with `G_r` the cumulative gate (sum of g over the chunk up to r),
    the state `S_0` at the chunk's start and `u_j` what token j writes (the delta rule's
    `beta_j (v_j - S^T k_j)` at its step), the recurrence unrolls to

        S_r = e^{G_r} S_0 + sum_{j <= r} e^{G_r - G_j} k_j u_j^T
        u_r = beta_r v_r - beta_r e^{G_r} S_0^T k_r - sum_{j < r} beta_r e^{G_r - G_j} (k_r . k_j) u_j

    i.e. `(I + A) U = beta V - (beta e^G K) S_0` with A strictly lower triangular: one triangular
    solve per chunk for both right-hand sides, independent of `S_0`, batched over all chunks. Then
    one step per chunk position carries the state: `U = W_v - W_k S_0`,
    `o_r = e^{G_r} S_0^T q_r + sum_{j <= r} e^{G_r - G_j} (q_r . k_j) u_j`,
    `S_C = e^{G_C} S_0 + sum_j e^{G_C - G_j} k_j u_j^T`. Every factor is e^{x} with x <= 0 (g <= 0),
    so nothing overflows. Chunks are padded to C with q = k = v = g = beta = 0, which writes
    nothing, decays nothing and is dropped. The sequences are not padded to the longest: every
    sequence is its own chunks (`_chunk_layout`), and the state of a sequence that has ended
    leaves the scan. Autograd keeps one `[d_k, d_v]` state per chunk and O(T C) intra-chunk
    values, against the recurrence's one state per token. The padding costs up to C - 1 slots per
    sequence, so rows of many sequences much shorter than C pay for it (as the recurrence pays
    for padding every sequence to the row's longest)."""
    dtype = v.dtype
    total, hv, dv = v.shape
    dk = k.shape[-1]
    if total == 0:
        return torch.zeros_like(v)
    rep = hv // k.shape[1]
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    q = l2norm(q) / dk ** 0.5
    k = l2norm(k)
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    index, valid, counts = _chunk_layout([int(c) for c in cu_seqlens.tolist()], chunk)
    index, valid = index.to(v.device), valid.to(v.device)

    def slots(x: torch.Tensor) -> torch.Tensor:          # [T, H, ...] -> [chunks, H, C, ...], padding zero
        out = x[index] * valid.view(*valid.shape, *([1] * (x.dim() - 1)))
        return out.transpose(1, 2)

    qc, kc, vc = slots(q), slots(k), slots(v)                                       # [n, H, C, d]
    gc, bc = slots(g), slots(beta)                                                  # [n, H, C]
    cum = gc.cumsum(dim=-1)                                                         # G_r
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    # G_r - G_j as the sum of g over (j, r], not as a difference of two large cumulative sums
    # (float32 cancellation: outputs 5e-5 off after 20 tokens of g = -200 followed by g near 0)
    between = gc[..., :, None].expand(*gc.shape, chunk).masked_fill(~causal.tril(-1), 0.0).cumsum(dim=-2)
    decay = between.masked_fill(~causal, float("-inf")).exp()                      # e^{G_r - G_j}, j <= r
    kb = kc * bc[..., None]
    lower = (kb @ kc.transpose(-1, -2)) * decay                                     # A (diagonal ignored below)
    rhs = torch.cat([vc * bc[..., None], kb * cum.exp()[..., None]], dim=-1)
    w = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    w_v, w_k = w.split([dv, dk], dim=-1)                                           # U = w_v - w_k S_0
    attn = (qc @ kc.transpose(-1, -2)) * decay                                      # (q_r . k_j) e^{G_r - G_j}
    q_decayed = qc * cum.exp()[..., None]
    k_to_end = kc * decay[..., -1, :, None]                                        # e^{G_C - G_j}
    chunk_decay = cum[..., -1].exp()[..., None, None]
    state = torch.zeros(counts[0], hv, dk, dv, dtype=torch.float32, device=v.device)
    outs, first = [], 0
    for m in counts:                                    # chunk position i: the first m sorted sequences
        part = slice(first, first + m)
        state = state[:m]
        u = w_v[part] - w_k[part] @ state
        outs.append(q_decayed[part] @ state + attn[part] @ u)
        state = state * chunk_decay[part] + k_to_end[part].transpose(-1, -2) @ u
        first += m
    out = torch.cat(outs).transpose(1, 2)[valid]                                    # [T, H, d_v], slot order
    where = index[valid]
    inverse = torch.empty_like(where)
    inverse[where] = torch.arange(where.numel(), device=where.device)
    return out[inverse].to(dtype)


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
    """The gated delta rule over one packed row (shapes as `recurrent_twin`), by `kernel_name`'s kernel
    (the twin is `chunked_twin`)."""
    if kernel_name(v.device) == "twin":
        return chunked_twin(q, k, v, g, beta, cu_seqlens)
    rep = v.shape[1] // k.shape[1]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    out, _ = fla_kernel()(q[None].contiguous(), k[None].contiguous(), v[None].contiguous(), g[None].float(),
                          beta[None].contiguous(), initial_state=None, output_final_state=False,
                          cu_seqlens=cu_seqlens.to(torch.long), use_qk_l2norm_in_kernel=True)
    return out[0].to(v.dtype)
