"""DAPO pieces that act on scores (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement
Learning System at Scale", arXiv:2503.14476).

- `overlong_penalty`: soft overlong punishment (length-aware reward shaping), added to the score.
- `keep_groups`: dynamic sampling filter, dropping prompts whose responses all scored the same
  (they have zero group-relative advantage, hence no gradient); `group_keep_metrics` logs it.
Clip-higher is `losses.ppo(..., eps_low=0.2, eps_high=0.28)`; token-mean is
`losses.aggregate(..., "token-mean")`. The generate-until-full loop belongs to the trainer.
"""
from __future__ import annotations

import torch

from ._masked import group_index, group_stats

__all__ = ["overlong_penalty", "keep_groups", "group_keep_metrics"]


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float) -> torch.Tensor:
    """Soft overlong penalty per response [B] (float32), `<= 0`, to add to the score.

    `min(-(len - (max_len - buffer)) / buffer * factor, 0)`: 0 up to `max_len - buffer` tokens,
    then linear down to `-factor` at `max_len` (verl's DAPO reward manager, same formula and
    order of operations). Lengths beyond `max_len` keep the slope (below `-factor`); the paper
    sets -1 there, but a capped generation never exceeds `max_len`.
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong buffer must be in (0, max_len={max_len}], got {buffer}")
    exceed = lengths.to(torch.float64) - (max_len - buffer)
    penalty = -exceed / buffer * factor
    return torch.clamp(penalty, max=0.0).to(torch.float32)


def keep_groups(scores: torch.Tensor, group: torch.Tensor, *, keep_singletons: bool = False) -> torch.Tensor:
    """bool [B]: True for responses whose group's scores are not all equal (exact comparison).

    A group of one response is all-equal and dropped unless `keep_singletons=True` (verl's DAPO
    trainer keeps singleton groups; its test is `np.std(scores) > 0`, which can also keep
    all-equal groups through rounding, e.g. three scores of 0.1; max == min cannot).
    """
    size, _, _, constant = group_stats(scores.to(torch.float64), group)
    keep = ~constant
    if keep_singletons:
        keep = keep | (size == 1)
    return keep


def group_keep_metrics(scores: torch.Tensor, group: torch.Tensor, *,
                       keep_singletons: bool = False) -> dict[str, torch.Tensor]:
    """`num_groups`, `num_groups_kept` (int64) and `kept_group_fraction` (float32; 0 when empty)."""
    keep = keep_groups(scores, group, keep_singletons=keep_singletons)
    inv, g = group_index(group)
    kept_per_group = torch.zeros(g, dtype=torch.bool, device=keep.device).scatter_(0, inv, keep)
    kept = kept_per_group.sum()
    total = torch.tensor(g, device=keep.device)
    return {
        "num_groups": total,
        "num_groups_kept": kept,
        "kept_group_fraction": kept.float() / max(g, 1),
    }
