"""Masked reductions, whitening and per-group statistics shared by the algorithm modules.

Conventions used throughout `mrl.algos`:
- a mask is a float, int or bool tensor; an entry is valid where it is nonzero;
- values at invalid positions are never read (they may be NaN or inf): every reduction selects
  with `torch.where` instead of multiplying by the mask;
- an empty selection reduces to 0, never NaN.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

AllReduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor element-wise over the data-parallel ranks and returns the result, e.g.
`lambda t: (torch.distributed.all_reduce(t, group=dp_group), t)[1]`."""


def valid(mask: torch.Tensor) -> torch.Tensor:
    """The mask as a bool tensor (nonzero = valid)."""
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Sum of `x` over valid entries (all entries, or along `dim`)."""
    picked = torch.where(valid(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return picked.sum() if dim is None else picked.sum(dim=dim)


def count(mask: torch.Tensor, dim: Optional[int] = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Number of valid entries, as `dtype`."""
    m = valid(mask).to(dtype)
    return m.sum() if dim is None else m.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of `x` over valid entries; 0 where nothing is valid."""
    n = count(mask, dim, dtype=x.dtype if x.is_floating_point() else torch.float32)
    return masked_sum(x, mask, dim) / n.clamp(min=1)


def metric_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Detached masked mean of a float or bool tensor, for logging (bool counts as float32)."""
    x = x.detach()
    if not x.is_floating_point():
        x = x.float()
    return masked_mean(x, mask)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-8,
                  all_reduce: Optional[AllReduce] = None) -> torch.Tensor:
    """`(x - mean) * rsqrt(var + eps)` over valid entries; invalid entries of the result are 0.

    verl's `masked_whiten` with exact statistics: mean over valid entries, *unbiased* variance
    `sum((x - mean)^2) / (n - 1)`, then `(x - mean) * rsqrt(var + 1e-8)`, accumulated in float64.
    Two departures from verl 0.9.1 (`verl/utils/torch_functional.py`), documented in
    docs/algorithms.md: verl's `masked_mean` divides by `n + 1e-8`, so where every valid entry
    equals c its mean misses c by `c 1e-8 / n` and the `rsqrt(var + 1e-8) ~ 1e4` turns that into
    `~1e-4 c / n` (5e-5 for two entries of 1 in float64; in float32 the sum's rounding decides),
    where this gives exactly 0; and verl raises when n <= 1, where var is taken as 0 here, so one
    valid entry whitens to 0 and none gives all 0. With `all_reduce` the statistics are those of
    the union over all ranks (two reductions).
    """
    ok = valid(mask)
    work = x if x.dtype in (torch.float32, torch.float64) else x.float()
    zero = torch.zeros((), dtype=work.dtype, device=work.device)
    # Statistics accumulate in float64 (exact token counts beyond 2^24, stable sums).
    stats = torch.stack([torch.where(ok, work, zero).sum(dtype=torch.float64),
                         ok.sum().to(torch.float64)])
    if all_reduce is not None:
        stats = all_reduce(stats)
    n = stats[1]
    mean = (stats[0] / n.clamp(min=1)).to(work.dtype)
    centered = torch.where(ok, work - mean, zero)
    sq = (centered * centered).sum(dtype=torch.float64).reshape(1)
    if all_reduce is not None:
        sq = all_reduce(sq)
    var = torch.where(n > 1, sq[0] / (n - 1).clamp(min=1), torch.zeros_like(n))
    return (centered * torch.rsqrt(var + eps).to(work.dtype)).to(x.dtype)


def group_index(group: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary int group ids [B] to dense indices 0..G-1; returns (inverse [B], G)."""
    if group.dim() != 1:
        raise ValueError(f"group must be 1-D [B], got shape {tuple(group.shape)}")
    uniq, inverse = torch.unique(group, return_inverse=True)
    return inverse, int(uniq.numel())


def group_stats(scores: torch.Tensor, group: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-response statistics of its group, vectorised, accumulated in float64.

    Returns `(size, mean, std, constant)`, each [B] and aligned with `scores`: the group's size,
    mean, *unbiased* std (0 for a group of one) and whether all its scores are equal. A constant
    group gets its common value as mean (exactly, so its deviations are exactly 0).
    """
    if scores.dim() != 1 or scores.shape != group.shape:
        raise ValueError(f"scores and group must both be [B]; got {tuple(scores.shape)} and {tuple(group.shape)}")
    inv, g = group_index(group)
    s = scores.detach().to(torch.float64)
    size = torch.zeros(g, dtype=torch.float64, device=s.device).index_add_(0, inv, torch.ones_like(s))
    total = torch.zeros(g, dtype=torch.float64, device=s.device).index_add_(0, inv, s)
    hi = torch.full((g,), -torch.inf, dtype=torch.float64, device=s.device).scatter_reduce_(0, inv, s, "amax")
    lo = torch.full((g,), torch.inf, dtype=torch.float64, device=s.device).scatter_reduce_(0, inv, s, "amin")
    constant = hi == lo
    mean = torch.where(constant, hi, total / size.clamp(min=1))
    dev = s - mean[inv]
    ssd = torch.zeros(g, dtype=torch.float64, device=s.device).index_add_(0, inv, dev * dev)
    std = torch.where(size > 1, (ssd / (size - 1).clamp(min=1)).sqrt(), torch.zeros_like(ssd))
    return size[inv], mean[inv], std[inv], constant[inv]


def broadcast_tokens(a: torch.Tensor, like: torch.Tensor, name: str = "adv") -> torch.Tensor:
    """Accept [B] (one value per response, broadcast over tokens) or [B,T] matching `like`."""
    if a.dim() == 1 and a.shape[0] == like.shape[0]:
        return a.unsqueeze(-1)
    if a.shape == like.shape:
        return a
    raise ValueError(f"{name} must be [B] or [B,T] = {tuple(like.shape)}, got {tuple(a.shape)}")
