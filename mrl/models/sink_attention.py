"""Causal attention with a sliding window and attention sinks, in plain torch (the CPU twin).

gpt-oss adds one learned logit per head to every softmax denominator (a "sink" that takes
probability mass and returns no value) and limits half its layers to a sliding window of
keys. torch's SDPA kernels take neither the sink nor a backward through one, so these layers
compute attention explicitly per packed sequence: scores `[H, L, L]`, the causal (and window)
mask, the sink appended as one more column, softmax in float32, the sink's column dropped - the
arithmetic of `transformers`' eager gpt-oss attention. Memory is O(H x L^2) per sequence (the
flash kernels' O(L) is what this gives up). On CUDA, Transformer Engine computes both natively
(megatron's `softmax_type = "learnable"`, `window_size`); windows without sinks are `varlen`'s
own window on CUDA and SDPA with `causal_window_mask` under `sdpa`.
"""
from __future__ import annotations

from typing import Optional

import torch


def causal_window_mask(length: int, window: Optional[int], device) -> torch.Tensor:
    """`[L, L]` bool, True where query i may see key j: `i - window <= j <= i` (`window` None:
    every earlier key). megatron's `window_size[0]` convention: a token sees itself and the
    `window` before it (transformers' `sliding_window` is `window + 1`)."""
    i = torch.arange(length, device=device)
    diff = i[:, None] - i[None, :]
    allowed = diff >= 0
    if window is not None:
        allowed &= diff <= window
    return allowed


def eager_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                 window: Optional[int] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of each packed sequence: q `[T, Hq, D]`, k/v `[T, Hkv, D]` -> `[T, Hq, Dv]`,
    keys limited to `window` before each query, and `sinks` (`[Hq]`, this rank's heads) a logit
    per head in each softmax denominator."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    rep = q.shape[1] // k.shape[1]
    outs = []
    for qs, ks, vs in zip(*(torch.split(x, lengths) for x in (q, k, v))):
        n = qs.shape[0]
        if n == 0:
            outs.append(qs.new_empty((0, q.shape[1], v.shape[2])))
            continue
        if rep > 1:
            ks, vs = ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale                     # [H, L, L]
        scores = scores.masked_fill(~causal_window_mask(n, window, scores.device), float("-inf"))
        if sinks is not None:
            column = sinks.to(scores.dtype).view(-1, 1, 1).expand(-1, n, 1)
            scores = torch.cat((scores, column), dim=-1)
        probs = torch.softmax(scores.float(), dim=-1).to(vs.dtype)
        if sinks is not None:
            probs = probs[..., :n]
        outs.append(torch.einsum("hqk,khd->qhd", probs, vs))
    return torch.cat(outs)
