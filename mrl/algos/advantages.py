"""Advantage estimators.

- `gae`: Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438), as used by
  PPO (Schulman et al. 2017, arXiv:1707.06347).
- `grpo`: group-relative advantage of GRPO (Shao et al., DeepSeekMath 2024, arXiv:2402.03300);
  `norm_by_std=False` is Dr.GRPO (Liu et al. 2025, arXiv:2503.20783).
- `rloo`: REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv:2402.14740).
- `reinforce_pp`, `reinforce_pp_baseline`: REINFORCE++ and its group-baseline variant
  (Hu 2025, arXiv:2501.03262).
- `remax`: ReMax, greedy-rollout baseline (Li et al. 2023, arXiv:2310.10505).
- `token_rewards`: places the scalar score on the last response token and subtracts the
  KL-in-reward penalty (Ziegler et al. 2019, arXiv:1909.08593).

All estimators run without autograd and return advantages that are 0 at masked positions.
Group ids are arbitrary int64 values; group statistics are vectorised (torch.unique +
index_add), accumulated in float64 and returned in the dtype of the scores.

Batch whitening (GAE, REINFORCE++) is over the whole batch passed in. In an SPMD trainer where
each data-parallel rank holds a slice of the batch, pass `all_reduce` (a callable summing a
tensor over the DP ranks) to whiten with the statistics of the global batch, as verl does on its
single controller.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._masked import AllReduce, group_stats, masked_whiten, valid

__all__ = ["gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "token_rewards"]


def _check_bt(name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
    if x.shape != mask.shape or x.dim() != 2:
        raise ValueError(f"{name} must be [B,T] like mask {tuple(mask.shape)}, got {tuple(x.shape)}")


def _float(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_floating_point() else x.to(torch.get_default_dtype())


@torch.no_grad()
def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float,
        *, whiten: bool = True, all_reduce: Optional[AllReduce] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and value targets; returns `(adv [B,T], returns [B,T])`.

    Backwards over t: `delta_t = r_t + gamma * V_next - V_t`, `A_t = delta_t + gamma*lam*A_next`,
    where `V_next`/`A_next` are those of the next *valid* token (0 past the end). A token with
    m = 0 (padding, or a tool observation inside a multi-turn response) passes `V_next` and
    `A_next` through unchanged and its own reward and value are ignored; this is verl's
    `compute_gae_advantage_return`. `returns = A + V` uses A before whitening. Then A is whitened
    over the mask (`masked_whiten`: unbiased variance, `(A - mean) * rsqrt(var + 1e-8)`), unless
    `whiten=False`. Both outputs are 0 where m = 0 (verl leaves values there that no loss reads).
    """
    _check_bt("token_rewards", token_rewards, mask)
    _check_bt("values", values, mask)
    ok = valid(mask)
    r, v = _float(token_rewards), _float(values).to(_float(token_rewards).dtype)
    b, t_len = r.shape
    next_value = torch.zeros(b, dtype=r.dtype, device=r.device)
    running = torch.zeros(b, dtype=r.dtype, device=r.device)
    adv = torch.zeros_like(r)
    for t in reversed(range(t_len)):
        delta = r[:, t] + gamma * next_value - v[:, t]
        here = ok[:, t]
        running = torch.where(here, delta + gamma * lam * running, running)
        next_value = torch.where(here, v[:, t], next_value)
        adv[:, t] = running
    zero = torch.zeros((), dtype=r.dtype, device=r.device)
    returns = torch.where(ok, adv + v, zero)
    adv = masked_whiten(adv, mask, all_reduce=all_reduce) if whiten else torch.where(ok, adv, zero)
    return adv, returns


@torch.no_grad()
def grpo(scores: torch.Tensor, group: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantage per response [B]: `(s_i - mean_g) / (std_g + eps)`.

    std is the unbiased (n-1) standard deviation of the group's scores. A group of one response
    gets mean 0 and std 1, so its advantage is `s_i / (1 + eps)` (verl's convention).
    `norm_by_std=False` is Dr.GRPO: `s_i - mean_g` (a group of one keeps `s_i`). A group whose
    scores are all equal gets exactly 0.
    """
    s = _float(scores)
    size, mean, std, _ = group_stats(s, group)
    single = size <= 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    centered = s.to(torch.float64) - mean
    if norm_by_std:
        std = torch.where(single, torch.ones_like(std), std)
        centered = centered / (std + eps)
    return centered.to(s.dtype)


@torch.no_grad()
def rloo(scores: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """RLOO advantage per response [B]: `s_i` minus the mean of the *other* responses of its group.

    Computed as `n/(n-1) * (s_i - mean_g)` in float64. A group of one
    has no other response to compare with and gets 0 (verl's vectorised RLOO does the same; its
    loop version leaves `s_i` unchanged).
    """
    s = _float(scores)
    size, mean, _, _ = group_stats(s, group)
    adv = size * (s.to(torch.float64) - mean) / (size - 1).clamp(min=1)
    return torch.where(size > 1, adv, torch.zeros_like(adv)).to(s.dtype)


@torch.no_grad()
def reinforce_pp(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float,
                 *, all_reduce: Optional[AllReduce] = None) -> torch.Tensor:
    """REINFORCE++ advantage [B,T]: discounted return, whitened over the mask.

    `G_t = r_t + gamma * G_next` on valid tokens; a token with m = 0 passes G through unchanged
    (no reward, no discount), as docs/algorithms.md specifies for multi-turn observations. (verl's
    `compute_reinforce_plus_plus_outcome_advantage` instead *resets* G to 0 at a masked token,
    which cuts the return of earlier turns; the two agree when masks are a prefix of ones.)
    Then batch whitening `(G - mean) * rsqrt(var + 1e-8)`, unbiased var over valid tokens.
    """
    _check_bt("token_rewards", token_rewards, mask)
    ok = valid(mask)
    r = _float(token_rewards)
    running = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    returns = torch.zeros_like(r)
    for t in reversed(range(r.shape[1])):
        running = torch.where(ok[:, t], r[:, t] + gamma * running, running)
        returns[:, t] = running
    return masked_whiten(returns, mask, all_reduce=all_reduce)


@torch.no_grad()
def reinforce_pp_baseline(scores: torch.Tensor, group: torch.Tensor, mask: torch.Tensor,
                          *, all_reduce: Optional[AllReduce] = None) -> torch.Tensor:
    """REINFORCE++-baseline advantage [B,T]: `s_i - mean_g` on every valid token, then whitened.

    The group mean of a group of one is 0 (so it contributes `s_i`), as in verl. Whitening is over
    all valid tokens of the batch, so longer responses weigh more in the statistics (verl too).
    """
    if mask.dim() != 2 or mask.shape[0] != scores.shape[0]:
        raise ValueError(f"mask must be [B,T] with B = {scores.shape[0]}, got {tuple(mask.shape)}")
    s = _float(scores)
    size, mean, _, _ = group_stats(s, group)
    mean = torch.where(size <= 1, torch.zeros_like(mean), mean)
    centered = (s.to(torch.float64) - mean).to(s.dtype)
    tokens = centered.unsqueeze(-1).expand(mask.shape)
    return masked_whiten(tokens, mask, all_reduce=all_reduce)


@torch.no_grad()
def remax(token_rewards: torch.Tensor, greedy_scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """ReMax advantage [B,T]: reward-to-go minus the greedy response's score, not whitened.

    `A_t = sum_{t' >= t} m_t' * r_t' - b_i` on valid tokens, where `b_i` ([B]) is the score of
    the greedy decode of response i's prompt. Undiscounted, as in verl's
    `compute_remax_outcome_advantage`; masked tokens contribute no reward.
    """
    _check_bt("token_rewards", token_rewards, mask)
    if greedy_scores.shape != token_rewards.shape[:1]:
        raise ValueError(f"greedy_scores must be [B], got {tuple(greedy_scores.shape)}")
    ok = valid(mask)
    r = _float(token_rewards)
    zero = torch.zeros((), dtype=r.dtype, device=r.device)
    to_go = torch.where(ok, r, zero).flip(-1).cumsum(-1).flip(-1)
    return torch.where(ok, to_go - greedy_scores.to(r.dtype).unsqueeze(-1), zero)


@torch.no_grad()
def token_rewards(scores: torch.Tensor, mask: torch.Tensor, kl: Optional[torch.Tensor] = None,
                  beta: float = 0.0) -> torch.Tensor:
    """Token-level rewards [B,T]: score on the last valid token, minus `beta * kl_t` on valid tokens.

    `kl` [B,T] is a per-token KL estimate (`mrl.algos.kl.estimate(old_logp, ref_logp, kind)`) for
    PPO-style KL-in-reward; it is ignored when None. A fully masked response gets no reward.
    """
    if mask.dim() != 2 or scores.shape != mask.shape[:1]:
        raise ValueError(f"scores must be [B] and mask [B,T]; got {tuple(scores.shape)}, {tuple(mask.shape)}")
    ok = valid(mask)
    s = _float(scores)
    out = torch.zeros(mask.shape, dtype=s.dtype, device=s.device)
    t_len = mask.shape[1]
    if t_len > 0:
        positions = torch.arange(t_len, device=mask.device).expand(mask.shape)
        last = torch.where(ok, positions, torch.full_like(positions, -1)).amax(dim=-1)
        rows = torch.nonzero(last >= 0).squeeze(-1)
        out[rows, last[rows]] = s[rows]
    if kl is not None:
        _check_bt("kl", kl, mask)
        out = out - beta * torch.where(ok, kl.to(s.dtype), torch.zeros((), dtype=s.dtype, device=s.device))
    return out
