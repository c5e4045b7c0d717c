"""Advantage estimators.

- `gae`: Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438), as used by
  PPO (Schulman et al. 2017, arXiv:1707.06347).
- `grpo`: group-relative advantage of GRPO (Shao et al., DeepSeekMath 2024, arXiv:2402.03300);
  `norm_by_std=False` is Dr.GRPO (Liu et al. 2025, arXiv:2503.20783).
- `rloo`: REINFORCE Leave-One-Out (Ahmadian et al. 2024, arXiv:2402.14740).
- `reinforce_pp`, `reinforce_pp_baseline`: REINFORCE++ and its group-baseline variant
  (Hu 2025, arXiv:2501.03262).
- `remax`: ReMax, greedy-rollout baseline (Li et al. 2023, arXiv:2310.10505).
- `opo`: On-Policy RL with Optimal reward baseline, length-weighted group mean (Hao et al. 2025,
  arXiv:2505.23585).
- `grpo_passk`: Pass@k training, only the best response of a group learns (Chen et al. 2025,
  arXiv:2503.19595).
- `gpg`: Group Policy Gradient's advantage, group-centred and rescaled by the share of nonzero
  scores (Chu et al. 2025, arXiv:2504.02546).
- `gdpo`: Group reward-Decoupled normalization Policy Optimization, one GRPO normalisation per
  reward component, then a weighted sum, whitened (arXiv:2601.05242).
- `optimal_token_baseline`, `tir_optimal_token_baseline`: per-token baseline weighted by the
  cumulative path variance (verl's OTB; the second compacts multi-turn responses first).
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

from ._masked import AllReduce, count, group_index, group_stats, masked_whiten, valid

__all__ = ["gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "opo", "grpo_passk", "gpg",
           "gdpo", "optimal_token_baseline", "tir_optimal_token_baseline", "token_rewards"]


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
    scores are all equal gets exactly 0 (a departure: verl 0.9.1 takes the group's float32 mean,
    which can miss the common value by a rounding step that the division by `std + 1e-6` then
    magnifies; three scores of 1.7694676 get -0.104 each there).
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
    (no reward, no discount), as docs/algorithms.md specifies for multi-turn observations. verl
    0.9.1's `compute_reinforce_plus_plus_outcome_advantage` does the same for a masked token
    *inside* a response (the return passes through it); past the end, where the mask is a suffix
    of zeros, both give 0 after whitening's masking.
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


def _group_sums(values: torch.Tensor, inv: torch.Tensor, g: int) -> torch.Tensor:
    """Per-group sums [G] of `values` [B] (float64)."""
    return torch.zeros(g, dtype=torch.float64, device=values.device).index_add_(0, inv, values.to(torch.float64))


@torch.no_grad()
def opo(scores: torch.Tensor, group: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """OPO advantage per response [B]: `s_i - b_g`, `b_g = sum_j L_j s_j / sum_j L_j` over the group.

    `L_j` is the number of valid tokens of response j (the length-weighted mean is the optimal
    constant baseline when the gradient's variance grows with length). A group of one gets
    baseline 0 (keeps `s_i`), as verl's `compute_opo_outcome_advantage`.
    """
    if mask.dim() != 2 or mask.shape[0] != scores.shape[0]:
        raise ValueError(f"mask must be [B,T] with B = {scores.shape[0]}, got {tuple(mask.shape)}")
    s = _float(scores)
    inv, g = group_index(group)
    lengths = count(mask, dim=-1, dtype=torch.float64)
    size = _group_sums(torch.ones_like(lengths), inv, g)
    num, den = _group_sums(lengths * s.to(torch.float64), inv, g), _group_sums(lengths, inv, g)
    base = torch.where((size > 1) & (den > 0), num / den.clamp(min=1e-30), torch.zeros_like(num))
    return (s.to(torch.float64) - base[inv]).to(s.dtype)


@torch.no_grad()
def grpo_passk(scores: torch.Tensor, group: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Pass@k advantage per response [B]: only the best response of each group gets a nonzero one.

    The best response (first of the group with the top score) gets `r_max - r_second`, divided
    by `std_g + eps` (unbiased std of the group's scores) unless `norm_by_std=False`; every other
    response gets 0. Every group needs at least 2 responses (verl raises too).
    """
    s = _float(scores)
    inv, g = group_index(group)
    size, _, std, _ = group_stats(s, group)
    if bool((size < 2).any()):
        raise ValueError("grpo_passk needs at least 2 responses in every group")
    s64 = s.to(torch.float64)
    top = torch.full((g,), -torch.inf, dtype=torch.float64, device=s.device).scatter_reduce_(0, inv, s64, "amax")
    positions = torch.arange(s.shape[0], device=s.device)
    is_top = s64 == top[inv]
    first = torch.full((g,), s.shape[0], dtype=torch.long, device=s.device).scatter_reduce_(
        0, inv[is_top], positions[is_top], "amin")
    best = positions == first[inv]
    second = torch.full((g,), -torch.inf, dtype=torch.float64, device=s.device).scatter_reduce_(
        0, inv[~best], s64[~best], "amax")
    adv = top - second
    if norm_by_std:
        adv = adv / (std.new_zeros(g).scatter_reduce_(0, inv, std, "amax") + eps)
    return torch.where(best, adv[inv], torch.zeros_like(s64)).to(s.dtype)


@torch.no_grad()
def gpg(scores: torch.Tensor, group: torch.Tensor, f_norm: float = 1.0,
        *, all_reduce: Optional[AllReduce] = None) -> torch.Tensor:
    """GPG advantage per response [B]: `alpha * (s_i - mean_g) / f_norm`, `alpha = B / #{s != 0}`.

    `alpha` (verl's `compute_gpg_outcome_advantage`) rescales the batch so that responses with a
    zero score do not dilute the gradient; `#{s != 0}` is clamped to at least 1. With `all_reduce`
    both counts are those of the global batch (verl computes them on its single controller).
    A group of one has mean 0. The group std is not used.
    """
    s = _float(scores)
    size, mean, _, _ = group_stats(s, group)
    mean = torch.where(size <= 1, torch.zeros_like(mean), mean)
    counts = torch.stack([torch.tensor(float(s.shape[0]), dtype=torch.float64, device=s.device),
                          (s != 0).sum().to(torch.float64)])
    if all_reduce is not None:
        counts = all_reduce(counts)
    alpha = counts[0] / counts[1].clamp(min=1)
    return (alpha * (s.to(torch.float64) - mean) / f_norm).to(s.dtype)


@torch.no_grad()
def gdpo(components: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, weights: Optional[torch.Tensor] = None,
         norm_by_std: bool = True, eps: float = 1e-6, *, all_reduce: Optional[AllReduce] = None) -> torch.Tensor:
    """GDPO advantage [B,T] from K reward components per response, `components` [B,K].

    Each component k is normalised on its own within the groups, `A_k = grpo(r_k)` (same
    conventions as `grpo`), so a dominant reward cannot drown a weak one; then
    `A = sum_k w_k A_k` (`weights` [K], default all 1) on every valid token, whitened over the
    valid tokens of the batch (`masked_whiten`, global with `all_reduce`), 0 at masked tokens.
    `norm_by_std` applies to every component (verl 0.9.1's trainer never passes
    `norm_adv_by_std_in_grpo` to GDPO, so there it is always True). When every `A` is equal the
    result is exactly 0, where verl's `masked_whiten` leaves `~1e-4 A / n` (see `masked_whiten`).
    """
    if components.dim() != 2 or components.shape[0] != group.shape[0]:
        raise ValueError(f"components must be [B,K] with B = {group.shape[0]}, got {tuple(components.shape)}")
    if mask.dim() != 2 or mask.shape[0] != group.shape[0]:
        raise ValueError(f"mask must be [B,T] with B = {group.shape[0]}, got {tuple(mask.shape)}")
    c = _float(components)
    w = torch.ones(c.shape[1], dtype=c.dtype, device=c.device) if weights is None else weights.to(c)
    if w.shape != (c.shape[1],):
        raise ValueError(f"weights must be [K] = [{c.shape[1]}], got {tuple(w.shape)}")
    total = sum(w[k] * grpo(c[:, k], group, norm_by_std=norm_by_std, eps=eps) for k in range(c.shape[1]))
    total = total if c.shape[1] else c.new_zeros(c.shape[0])
    return masked_whiten(total.unsqueeze(-1).expand(mask.shape), mask, all_reduce=all_reduce)


def _otb_baselines(returns: torch.Tensor, w_cum: torch.Tensor, ok: torch.Tensor, group: torch.Tensor,
                   handle_zero_tail: bool, eps: float) -> torch.Tensor:
    """Per-position group baseline `sum_i G_it W_it / (sum_i W_it + eps)` over the valid entries."""
    inv, g = group_index(group)
    zero = torch.zeros((), dtype=returns.dtype, device=returns.device)
    gw = torch.where(ok, returns * w_cum, zero)
    ww = torch.where(ok, w_cum, zero)
    num = torch.zeros((g,) + returns.shape[1:], dtype=returns.dtype, device=returns.device).index_add_(0, inv, gw)
    den = torch.zeros_like(num).index_add_(0, inv, ww)
    size = torch.zeros(g, dtype=returns.dtype, device=returns.device).index_add_(0, inv, torch.ones_like(returns[:, 0]))
    base = num / (den + eps)
    base = torch.where(size.unsqueeze(-1) > 1, base, torch.zeros_like(base))[inv]
    if handle_zero_tail:
        lengths = ok.sum(-1)
        for gid in range(g):
            rows = torch.nonzero(inv == gid).squeeze(-1)
            if rows.numel() < 2:
                continue
            ordered = torch.sort(lengths[rows]).values
            longest, second = int(ordered[-1]), int(ordered[-2])
            if longest > second:   # one response alone is longer: its tail has no peer to compare with
                base[rows[lengths[rows] == longest][0], second:] = 0.0
    return base


def _otb_returns_and_weights(token_rewards: torch.Tensor, ok: torch.Tensor, old_logp: torch.Tensor,
                             sum_pi_squared: torch.Tensor, is_weights: Optional[torch.Tensor]):
    """The optimal token baselines' shared inputs: undiscounted reward-to-go `G` over valid tokens,
    the cumulative variance proxy `W_t = sum_{k<=t} (1 - 2 pi_k + sum pi^2)_k * rho_k^2`, and a
    zero of their dtype."""
    r = _float(token_rewards)
    zero = torch.zeros((), dtype=r.dtype, device=r.device)
    returns = torch.where(ok, r, zero).flip(-1).cumsum(-1).flip(-1)
    per_token = 1.0 - 2.0 * torch.exp(old_logp.to(r.dtype)) + sum_pi_squared.to(r.dtype)
    if is_weights is not None:
        per_token = per_token * is_weights.to(r.dtype) ** 2
    return returns, torch.where(ok, per_token, zero).cumsum(-1), zero


@torch.no_grad()
def optimal_token_baseline(token_rewards: torch.Tensor, mask: torch.Tensor, group: torch.Tensor,
                           old_logp: torch.Tensor, sum_pi_squared: torch.Tensor,
                           is_weights: Optional[torch.Tensor] = None, *, handle_zero_tail: bool = True,
                           eps: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal Token Baseline advantage; returns `(adv [B,T], returns [B,T])`.

    `G_t` = undiscounted reward-to-go over valid tokens. The per-token variance proxy
    `||s_t||^2 = 1 - 2 pi_t + sum_v pi_v^2` (`pi_t = exp(old_logp_t)`, `sum_pi_squared` [B,T] the
    sum of squared probabilities over the vocabulary), times `is_weights^2` when given, is summed
    over the valid tokens up to t: `W_t`. The baseline at position t is, over the responses of
    the group, `B_t = sum_i G_it W_it / (sum_i W_it + eps)` (valid entries only); a group of one
    gets 0. `handle_zero_tail` (default True, as verl 0.9.1's `compute_optimal_token_baseline_
    advantage`, which its trainers call without overriding it): when one response is strictly the
    longest of its group, its baseline beyond the second-longest length is 0 (else it would be
    its own return, `G W / (W + eps)`, and its advantage ~1e-8 G there). `A = (G - B)` on valid
    tokens, 0 elsewhere.
    """
    _check_bt("token_rewards", token_rewards, mask)
    _check_bt("old_logp", old_logp, mask)
    _check_bt("sum_pi_squared", sum_pi_squared, mask)
    ok = valid(mask)
    returns, w_cum, zero = _otb_returns_and_weights(token_rewards, ok, old_logp, sum_pi_squared, is_weights)
    base = _otb_baselines(returns, w_cum, ok, group, handle_zero_tail, eps)
    return torch.where(ok, returns - base, zero), returns


@torch.no_grad()
def tir_optimal_token_baseline(token_rewards: torch.Tensor, mask: torch.Tensor, group: torch.Tensor,
                               old_logp: torch.Tensor, sum_pi_squared: torch.Tensor,
                               is_weights: Optional[torch.Tensor] = None, *, handle_zero_tail: bool = True,
                               eps: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal Token Baseline for multi-turn (tool-integrated) responses; `(adv, returns)`.

    As `optimal_token_baseline`, but each response's valid tokens are first compacted to the
    left (tool-observation tokens with m = 0 removed), so the k-th *policy* token of every
    response of a group shares a baseline, whatever the observations before it; the advantages
    are scattered back to the original positions. Fully masked responses are left out of their
    group. `handle_zero_tail` defaults to True here (verl's default for this estimator).
    """
    _check_bt("token_rewards", token_rewards, mask)
    ok = valid(mask)
    returns, w_cum, zero = _otb_returns_and_weights(token_rewards, ok, old_logp, sum_pi_squared, is_weights)
    lengths = ok.sum(-1)
    width = int(lengths.max()) if lengths.numel() else 0
    # stable sort puts valid positions first in their original order: compaction
    order = torch.sort((~ok).to(torch.int8), dim=-1, stable=True).indices[:, :width]
    packed_ok = torch.arange(width, device=returns.device).unsqueeze(0) < lengths.unsqueeze(-1)
    packed_g = torch.gather(returns, 1, order)
    packed_w = torch.gather(w_cum, 1, order)
    rows = lengths > 0
    adv = torch.zeros_like(returns)
    if bool(rows.any()):
        base = _otb_baselines(packed_g[rows], packed_w[rows], packed_ok[rows], group[rows], handle_zero_tail, eps)
        packed_adv = torch.where(packed_ok[rows], packed_g[rows] - base, zero)
        sub = torch.zeros_like(returns[rows]).scatter_(1, order[rows], packed_adv)
        adv[rows] = sub
    return torch.where(ok, adv, zero), returns


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


@torch.no_grad()
def distill(old_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor, coef: float = 1.0,
            task: Optional[torch.Tensor] = None, task_weight: float = 0.0) -> torch.Tensor:
    """On-policy distillation advantage per token [B, T] (Agarwal et al. 2024, arXiv:2306.13649;
    Lu & Thinking Machines 2025, "On-Policy Distillation"): `-coef * (lp_old_t - lp_teacher_t)`,
    the negated sampled-token estimate of the reverse KL `KL(student || teacher)` at each of the
    student's own tokens, plus `task_weight * task` (a per-response advantage [B] of the task
    reward, e.g. `grpo`) when given. No discounting: each token is credited its own term, as in
    the references. 0 at masked positions."""
    keep = mask > 0
    diff = torch.where(keep, old_logprobs.double() - teacher_logprobs.double(), torch.zeros_like(old_logprobs.double()))
    a = -coef * diff
    if task is not None and task_weight:
        a = a + task_weight * task.double().unsqueeze(-1)
    return (a * keep).to(old_logprobs.dtype)
