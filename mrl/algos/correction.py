"""Rollout correction: importance weights for the train/inference mismatch.

The rollout engine samples from `pi_roll` (its own kernels, precision, possibly stale weights);
the trainer's `old` policy recomputes `lp_old`. Weights `pi_old / pi_roll` reweight the loss.
- `mode="truncate"`: truncated importance sampling, TIS (Yao et al. 2025, "Your Efficient RL
  Framework Secretly Brings You Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl):
  `w = min(w, C)`.
- `mode="mask"`: masked importance sampling in the style of IcePop (Ling Team, Ring-1T 2025,
  arXiv:2510.18855): a weight outside `[lo, hi]` becomes 0, one inside keeps its value.
- `level="token"` weights each token by its own ratio; `level="sequence"` by the product of the
  sequence's token ratios (the unbiased sequence-level IS weight), broadcast to its tokens.

`mismatch_metrics` logs the size of the mismatch (KL, |log ppl diff|, chi^2) as verl's
`rollout_corr/*`; `weight_metrics` logs what the correction did.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ._masked import AllReduce, count, masked_mean, masked_sum, valid

__all__ = ["weights", "weight_metrics", "mismatch_metrics"]

LEVELS = ("token", "sequence")
MODES = ("truncate", "mask")
Threshold = Union[float, Sequence[float]]


def _check(old_logp, rollout_logp, mask, level, threshold, mode) -> tuple[float, float]:
    if old_logp.dim() != 2 or old_logp.shape != rollout_logp.shape or old_logp.shape != mask.shape:
        raise ValueError("old_logp, rollout_logp and mask must all be [B,T]")
    if level not in LEVELS:
        raise ValueError(f"unknown rollout-correction level {level!r}; expected one of {LEVELS}")
    if mode == "truncate":
        if isinstance(threshold, (tuple, list)) or threshold is None or not float(threshold) > 0:
            raise ValueError(f"truncate mode needs a threshold C > 0, got {threshold!r}")
        return 0.0, float(threshold)
    if mode == "mask":
        if not isinstance(threshold, (tuple, list)) or len(threshold) != 2:
            raise ValueError(f"mask mode needs threshold (lo, hi), got {threshold!r}")
        lo, hi = float(threshold[0]), float(threshold[1])
        if not 0 <= lo <= hi:
            raise ValueError(f"mask mode needs 0 <= lo <= hi, got ({lo}, {hi})")
        return lo, hi
    raise ValueError(f"unknown rollout-correction mode {mode!r}; expected one of {MODES}")


def _raw(old_logp, rollout_logp, ok, level):
    """Uncorrected weights [B,T] (0 at masked tokens) and the log ratio they came from."""
    zero = torch.zeros((), dtype=old_logp.dtype, device=old_logp.device)
    log_ratio = torch.where(ok, old_logp.detach() - rollout_logp.detach().to(old_logp.dtype), zero)
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand(ok.shape)
    raw = torch.where(ok, torch.exp(torch.clamp(log_ratio, -20.0, 20.0)), zero)
    return raw, log_ratio


def _apply(raw: torch.Tensor, ok: torch.Tensor, mode: str, lo: float, hi: float):
    """Corrected weights and the bool [B,T] of valid tokens whose weight was changed."""
    if mode == "truncate":
        changed = ok & (raw > hi)
        return torch.clamp(raw, max=hi), changed
    changed = ok & ((raw < lo) | (raw > hi))
    return torch.where(changed, torch.zeros_like(raw), raw), changed


@torch.no_grad()
def weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, level: str,
            threshold: Threshold, mode: str, *, normalize: bool = False,
            all_reduce: Optional[AllReduce] = None) -> torch.Tensor:
    """Detached rollout-correction weights [B,T] (0 at masked tokens), to pass as `weights=`.

    `lr = lp_old - lp_roll`. `level="token"`: `w_t = exp(clamp(lr_t, -20, 20))`;
    `level="sequence"`: `w = exp(clamp(sum_t m*lr_t, -20, 20))` on every token of the sequence.
    `mode="truncate"` (TIS, `threshold` = C > 0, docs/algorithms.md's default 2): `w = min(w, C)`.
    `mode="mask"` (IcePop style, `threshold` = (lo, hi)): `w = 0` outside `[lo, hi]` (bounds
    inclusive), unchanged inside.
    `normalize=True` divides by the batch mean weight after truncation/masking, so the mean is 1:
    the mean over valid tokens (token level) or over non-empty sequences (sequence level), as
    verl's `rollout_is_batch_normalize`; skipped when that mean is <= 1e-8. With `all_reduce`
    the mean is over all data-parallel ranks.
    """
    lo, hi = _check(old_logp, rollout_logp, mask, level, threshold, mode)
    ok = valid(mask)
    raw, _ = _raw(old_logp, rollout_logp, ok, level)
    w, _ = _apply(raw, ok, mode, lo, hi)
    if normalize:
        if level == "token":
            stats = torch.stack([w.sum(dtype=torch.float64), ok.sum().to(torch.float64)])
        else:
            # every valid token of a sequence carries its weight (>= 0); other entries are 0
            seq_w = w.amax(dim=-1) if w.shape[1] else w.new_zeros(w.shape[0])
            stats = torch.stack([seq_w.sum(dtype=torch.float64), ok.any(dim=-1).sum().to(torch.float64)])
        if all_reduce is not None:
            stats = all_reduce(stats)
        mean = stats[0] / stats[1].clamp(min=1)
        w = torch.where(mean > 1e-8, w / mean.clamp(min=1e-8).to(w.dtype), w)
    return w


@torch.no_grad()
def weight_metrics(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, level: str,
                   threshold: Threshold, mode: str) -> dict[str, torch.Tensor]:
    """What the correction does to this batch (detached 0-dim tensors; before normalisation).

    - `weight_mean`: mean corrected weight over valid tokens;
    - `raw_weight_max`, `raw_weight_min`: extreme uncorrected weights over valid tokens;
    - `changed_token_fraction`: valid tokens whose weight was truncated (truncate) or zeroed (mask);
    - `changed_sequence_fraction`: non-empty sequences with at least one such token;
    - `ess_fraction`: effective sample size over the token count, `mean(w)^2 / mean(w^2)`, in (0, 1].
    """
    lo, hi = _check(old_logp, rollout_logp, mask, level, threshold, mode)
    ok = valid(mask)
    raw, _ = _raw(old_logp, rollout_logp, ok, level)
    w, changed = _apply(raw, ok, mode, lo, hi)
    any_ok = ok.any()
    mean_w = masked_mean(w, ok)
    mean_sq = masked_mean(w * w, ok)
    seq_ok = ok.any(dim=-1)
    inf = torch.tensor(torch.inf, dtype=raw.dtype, device=raw.device)
    zero = torch.zeros((), dtype=raw.dtype, device=raw.device)
    return {
        "weight_mean": mean_w,
        "raw_weight_max": torch.where(any_ok, torch.where(ok, raw, -inf).max(), zero) if raw.numel() else zero,
        "raw_weight_min": torch.where(any_ok, torch.where(ok, raw, inf).min(), zero) if raw.numel() else zero,
        "changed_token_fraction": masked_mean(changed.to(raw.dtype), ok),
        "changed_sequence_fraction": masked_mean(changed.any(dim=-1).to(raw.dtype), seq_ok),
        "ess_fraction": torch.where(mean_sq > 0, mean_w * mean_w / mean_sq.clamp(min=1e-30), zero),
    }


@torch.no_grad()
def mismatch_metrics(old_logp: torch.Tensor, rollout_logp: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Train/inference mismatch statistics (detached 0-dim tensors), as verl's `rollout_corr/*`.

    With `lr = lp_old - lp_roll` over valid tokens:
    - `kl`: mean over tokens of `lp_roll - lp_old`, the k1 estimate of KL(pi_roll || pi_old);
    - `k3_kl`: mean of `exp(lr) - lr - 1` (lr clamped to ±20; via expm1), the k3 estimate of the same KL;
    - `log_ppl_diff`: mean over non-empty sequences of `mean_t lp_roll - mean_t lp_old`, i.e.
      log(ppl_old / ppl_roll); `log_ppl_abs_diff`: the mean of its absolute value;
    - `chi2_token`: `mean_t exp(clamp(lr, ±20))^2 - 1`, chi^2(pi_old || pi_roll) per token;
    - `chi2_seq`: mean over non-empty sequences of `exp(2*clamp(sum_t lr, ±20)) - 1`.
    verl averages its sequence statistics over all rows, counting fully masked rows as 0 (and
    their chi2 term as 1); here such rows are left out. Empty input gives 0 for every metric.
    """
    if old_logp.dim() != 2 or old_logp.shape != rollout_logp.shape or old_logp.shape != mask.shape:
        raise ValueError("old_logp, rollout_logp and mask must all be [B,T]")
    ok = valid(mask)
    zero = torch.zeros((), dtype=old_logp.dtype, device=old_logp.device)
    old = torch.where(ok, old_logp, zero)
    roll = torch.where(ok, rollout_logp.to(old.dtype), zero)
    lr = old - roll
    lr_safe = torch.clamp(lr, -20.0, 20.0)
    seq_ok = ok.any(dim=-1)
    tokens = count(ok, dim=-1, dtype=old.dtype).clamp(min=1)
    log_ppl_diff = roll.sum(dim=-1) / tokens - old.sum(dim=-1) / tokens
    seq_lr = torch.clamp(masked_sum(lr, ok, dim=-1), -20.0, 20.0)
    return {
        "kl": masked_mean(-lr, ok),
        "k3_kl": masked_mean(torch.expm1(lr_safe) - lr_safe, ok),
        "log_ppl_diff": masked_mean(log_ppl_diff, seq_ok),
        "log_ppl_abs_diff": masked_mean(log_ppl_diff.abs(), seq_ok),
        "chi2_token": torch.where(ok.any(), masked_mean(torch.exp(lr_safe).square(), ok) - 1.0, zero),
        "chi2_seq": torch.where(seq_ok.any(), masked_mean(torch.exp(2.0 * seq_lr), seq_ok) - 1.0, zero),
    }
