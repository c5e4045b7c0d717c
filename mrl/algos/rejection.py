"""Rollout rejection sampling: drop tokens or whole responses whose training and rollout
policies disagree too much (verl's `rollout_rs`), and PF-PPO's reward-weighted resampling.

`mask` builds a keep-mask [B,T] from `lr = lp_old - lp_roll` (trainer over rollout engine) with
one or more criteria, all of which must pass (verl's comma-separated `rollout_rs`):
- `token_k1|k2|k3`: per token; `seq_sum_k*`, `seq_mean_k*`: the sum / mean of the token values
  over the response; `seq_max_k2|k3`: their maximum. A sequence criterion keeps or drops every
  token of the response.
- The token values are `k1 = -lr`, `k2 = lr^2 / 2`, `k3 = exp(lr) - 1 - lr` (lr clamped to
  +-20). A k1 criterion keeps `log(lower) <= value <= log(upper)` (bounds given as ratios); a k2
  or k3 criterion keeps `value <= upper`.
The result multiplies the response mask, so rejected tokens leave the loss *and* its token and
sequence counts, as in verl. It composes with `mrl.algos.correction.weights` (the kept tokens
keep their importance weights). `PRESETS` holds verl's `RolloutCorrectionConfig` presets by name.

`pf_ppo_indices`: Policy Filtration PPO (Shen et al. 2025, arXiv:2409.06957) resamples the batch
with replacement, each response with probability proportional to a weight of its score.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from ._masked import masked_mean, masked_sum, valid
from .rejection_spec import CRITERIA, PRESETS, Criterion, Preset, parse

__all__ = ["CRITERIA", "PRESETS", "Criterion", "Preset", "parse", "mask", "mask_metrics", "PF_PPO_METHODS",
           "pf_ppo_weights", "pf_ppo_indices"]

def _token_values(lr: torch.Tensor, kind: str) -> torch.Tensor:
    lr = torch.clamp(lr, -20.0, 20.0)
    if kind == "k1":
        return -lr
    if kind == "k2":
        return 0.5 * lr * lr
    return torch.expm1(lr) - lr


def _statistic(c: Criterion, lr: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """The criterion's value per token [B,T] (a sequence criterion repeats its value)."""
    level, _, kind = c.name.rpartition("_")
    v = _token_values(lr, kind)
    if level == "token":
        return v
    if level == "seq_sum":
        s = masked_sum(v, ok, dim=-1)
    elif level == "seq_mean":
        s = masked_mean(v, ok, dim=-1)
    else:
        s = torch.where(ok, v, torch.full_like(v, -torch.inf)).amax(dim=-1) if v.shape[1] else v.new_zeros(v.shape[0])
        s = torch.where(torch.isinf(s), torch.zeros_like(s), s)
    return s.unsqueeze(-1).expand(ok.shape)


def _keep(c: Criterion, stat: torch.Tensor) -> torch.Tensor:
    if c.lower is not None:
        return (stat >= math.log(c.lower)) & (stat <= math.log(c.upper))
    return stat <= c.upper


@torch.no_grad()
def mask(old_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor,
         criteria: Sequence[Criterion]) -> torch.Tensor:
    """Keep-mask [B,T] (bool; False at masked tokens): tokens passing every criterion."""
    if old_logp.dim() != 2 or old_logp.shape != rollout_logp.shape or old_logp.shape != response_mask.shape:
        raise ValueError("old_logp, rollout_logp and response_mask must all be [B,T]")
    ok = valid(response_mask)
    lr = torch.where(ok, old_logp.detach() - rollout_logp.detach().to(old_logp.dtype), torch.zeros_like(old_logp))
    keep = ok.clone()
    for c in criteria:
        keep &= _keep(c, _statistic(c, lr, ok))
    return keep


@torch.no_grad()
def mask_metrics(old_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor,
                 criteria: Sequence[Criterion]) -> dict[str, torch.Tensor]:
    """What rejection does (detached 0-dim tensors), per criterion `<name>/...` and overall:
    `masked_fraction` (valid tokens rejected), `seq_masked_fraction` (responses with a rejected
    token), and per criterion `<name>/mean` (mean statistic over valid tokens). As verl 0.9.1's
    `compute_rollout_rejection_mask`, a criterion's `seq_masked_fraction` is over the non-empty
    responses, the overall one over all rows (a fully masked row counts as not rejected)."""
    ok = valid(response_mask)
    seq_ok = ok.any(dim=-1)
    lr = torch.where(ok, old_logp.detach() - rollout_logp.detach().to(old_logp.dtype), torch.zeros_like(old_logp))
    out: dict[str, torch.Tensor] = {}
    keep_all = ok.clone()
    for c in criteria:
        stat = _statistic(c, lr, ok)
        keep = _keep(c, stat) & ok
        keep_all &= keep
        out[f"{c.name}/masked_fraction"] = masked_mean((ok & ~keep).to(lr.dtype), ok)
        out[f"{c.name}/seq_masked_fraction"] = masked_mean((ok & ~keep).any(dim=-1).to(lr.dtype), seq_ok)
        out[f"{c.name}/mean"] = masked_mean(stat, ok)
    out["masked_fraction"] = masked_mean((ok & ~keep_all).to(lr.dtype), ok)
    rows = torch.ones_like(seq_ok)
    out["seq_masked_fraction"] = masked_mean((ok & ~keep_all).any(dim=-1).to(lr.dtype), rows)
    return out


PF_PPO_METHODS = ("pow", "max_min", "max_random")


@torch.no_grad()
def pf_ppo_weights(scores: torch.Tensor, method: str = "pow", weight_pow: float = 2.0) -> torch.Tensor:
    """PF-PPO sampling weights [B] of the responses' scores (verl's `compute_pf_ppo_reweight_data`).

    - `pow`: `|s|^weight_pow`;
    - `max_min`: 1 for responses with the batch's highest or lowest score, else 0;
    - `max_random`: 0.4 for the highest score, else 0.1.
    Every weight is then raised to at least 1e-8 (`clamp(w + 1e-8, min=1e-8)`), so all can be drawn.
    """
    s = scores.detach().to(torch.float64)
    if method == "pow":
        w = s.abs().pow(weight_pow)
    elif method == "max_min":
        w = ((s == s.max()) | (s == s.min())).to(torch.float64)
    elif method == "max_random":
        w = torch.where(s == s.max(), 0.4, 0.1).to(torch.float64)
    else:
        raise ValueError(f"unknown PF-PPO reweight method {method!r}; expected one of {PF_PPO_METHODS}")
    return torch.clamp(w + 1e-8, min=1e-8)


@torch.no_grad()
def pf_ppo_indices(scores: torch.Tensor, method: str = "pow", weight_pow: float = 2.0,
                   generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """B indices [B] drawn with replacement with probability proportional to `pf_ppo_weights`."""
    if scores.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    return torch.multinomial(pf_ppo_weights(scores, method, weight_pow), scores.shape[0], replacement=True,
                             generator=generator)
