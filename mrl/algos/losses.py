"""Policy and value losses, and loss aggregation.

- `ppo`: clipped surrogate of PPO (Schulman et al. 2017, arXiv:1707.06347) with optional
  dual-clip (Ye et al. 2020, arXiv:1912.09729); `eps_high > eps_low` is DAPO's clip-higher
  (Yu et al. 2025, arXiv:2503.14476).
- `gspo`: Group Sequence Policy Optimization, token-level form GSPO-token (Zheng et al. 2025,
  arXiv:2507.18071).
- `cispo`: Clipped IS-weight Policy Optimization (MiniMax-M1, 2025, arXiv:2506.13585).
- `sapo`: Soft Adaptive Policy Optimization, sigmoid-gated surrogate (Qwen team 2025,
  arXiv:2511.20347).
- `gpg`: Group Policy Gradient, plain `-A * lp` (Chu et al. 2025, arXiv:2504.02546).
- `dppo_tv`, `dppo_kl`: Divergence PPO, a binary total-variation / binary-KL trust region on the
  sampled token's probability instead of the ratio clip, with a truncated IS weight
  (arXiv:2602.04879).
- `clip_cov`, `kl_cov`: Clip-Cov and KL-Cov against entropy collapse, which stop or penalise the
  tokens whose advantage and log-prob covary most (Cui et al. 2025, arXiv:2505.22617).
- `geo_mean`: GMPO, geometric mean of clipped token ratios per sequence (Zhao et al. 2025,
  arXiv:2507.20673).
- `dro`: Direct Reward Optimization's quadratic proximal penalty instead of a clip
  (Richemond et al. 2024, arXiv:2405.19107), as verl's `dro`.
- `reinforce`: REINFORCE with truncated IS weights against the rollout policy, verl's
  `bypass_mode` with `loss_type = reinforce`.
- `value` (clipped value loss of PPO's critic) and `aggregate` (`loss_agg_mode`, split-invariant
  with the global counts) live in `mrl.algos.aggregation` and are re-exported here.

Policy losses return `(per_token [B,T], metrics)`: the loss of every token *before*
aggregation, 0 at masked positions, multiplied by the rollout-correction `weights` when given;
`metrics` maps names to detached 0-dim tensors (masked means over the valid tokens of the call;
call `.item()` when logging). `adv` may be [B] (one advantage per response) or [B,T].
Masked positions of every input are replaced by 0 before use, so padding values (even NaN) reach
neither the loss nor the gradient. Ratios are `r = exp(clamp(lp - lp_old, -20, 20))`.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._masked import broadcast_tokens, count, masked_sum, metric_mean, valid
from .aggregation import AGG_MODES, aggregate, value   # re-exported: losses.aggregate, losses.value

__all__ = ["AGG_MODES", "FORCED_AGG_MODE", "ALL_ROWS_LOSSES", "ppo", "gspo", "cispo", "sapo", "gpg", "dppo_tv", "dppo_kl",
           "clip_cov", "kl_cov", "geo_mean", "dro", "reinforce", "aggregate", "value"]

FORCED_AGG_MODE = {"sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-token-mean"}
"""Losses whose definition fixes the aggregation (docs/algorithms.md; verl 0.9.1 ignores
loss_agg_mode for these). A trainer aggregates their per-token losses with this mode, whatever is
configured. GSPO is not among them: verl 0.9.1 aggregates it with the configured mode."""

ALL_ROWS_LOSSES = frozenset({"geo_mean"})
"""Losses whose sequence mean counts every row, fully masked ones too (verl 0.9.1's geo_mean is
`torch.mean` over the rows): a trainer passes the mini-batch's row count as `global_sequences`."""



def _prepare(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
             weights: Optional[torch.Tensor]):
    if logp.dim() != 2 or logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(f"logp, old_logp and mask must all be [B,T]; got {tuple(logp.shape)}, "
                         f"{tuple(old_logp.shape)}, {tuple(mask.shape)}")
    ok = valid(mask)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp = torch.where(ok, logp, zero)
    old_logp = torch.where(ok, old_logp.detach().to(logp.dtype), zero)
    a = broadcast_tokens(adv.detach().to(logp.dtype), logp, "adv")
    a = torch.where(ok, a, zero)  # [B,T]; masked advantages never count (metrics, signs)
    w = None
    if weights is not None:
        w = torch.where(ok, broadcast_tokens(weights.detach().to(logp.dtype), logp, "weights"), zero)
    return ok, zero, logp, old_logp, a, w


def _finish(per_token: torch.Tensor, ok: torch.Tensor, zero: torch.Tensor, w: Optional[torch.Tensor]):
    if w is not None:
        per_token = per_token * w
    return torch.where(ok, per_token, zero)


def _clipped_surrogate(ratio, a, eps_low, eps_high):
    """PPO's pessimistic surrogate `max(-A r, -A clip(r))` and where the clip is active."""
    unclipped = -a * ratio
    clipped = -a * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _check_eps(eps_low, eps_high):
    if eps_low is None or eps_high is None or eps_low < 0 or eps_high < 0:
        raise ValueError(f"eps_low and eps_high must be >= 0, got {eps_low}, {eps_high}")


def ppo(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
        eps_low: float, eps_high: float, clip_c: Optional[float] = None,
        *, weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate per token, with optional dual-clip.

    `L = max(-A*r, -A*clip(r, 1-eps_low, 1+eps_high))`; where `A < 0` and `clip_c` is set,
    `L = min(L, -A*clip_c)` (dual-clip bounds the loss of a negative-advantage token whose ratio
    exploded; `clip_c` must be > 1, verl's default is 3, DAPO's recipe uses 10). `clip_c=None`
    means no dual clip. Where a clip is active the token's gradient is 0.

    Metrics (fractions of valid tokens): `clipfrac_upper` (A > 0, r > 1+eps_high),
    `clipfrac_lower` (A < 0, r < 1-eps_low), `clipfrac` (their sum = verl's `pg_clipfrac`),
    `clipfrac_dual` (A < 0 and the dual clip is active = verl's `pg_clipfrac_lower`), and
    `approx_kl` = mean(lp_old - lp) with the ±20 clamp (verl's `ppo_kl`).
    """
    _check_eps(eps_low, eps_high)
    if clip_c is not None and not clip_c > 1.0:
        raise ValueError(f"clip_c (dual-clip ratio bound) must be > 1, got {clip_c}")
    ok, zero, logp, old_logp, a, w = _prepare(logp, old_logp, adv, mask, weights)
    log_ratio = torch.clamp(logp - old_logp, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    loss, clip_active = _clipped_surrogate(ratio, a, eps_low, eps_high)
    negative = a < 0
    if clip_c is not None:
        dual_bound = -a * clip_c
        dual_active = negative & (loss > dual_bound)
        loss = torch.where(negative, torch.minimum(loss, dual_bound), loss)
    else:
        dual_active = torch.zeros_like(ok)
    upper = metric_mean(clip_active & (a > 0), ok)
    lower = metric_mean(clip_active & negative, ok)
    metrics = {
        "clipfrac": upper + lower,
        "clipfrac_upper": upper,
        "clipfrac_lower": lower,
        "clipfrac_dual": metric_mean(dual_active, ok),
        "approx_kl": metric_mean(-log_ratio, ok),
    }
    return _finish(loss, ok, zero, w), metrics


def gspo(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
         eps_low: float, eps_high: float,
         *, weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO(-token) surrogate per token, aggregated with the configured mode (verl 0.9.1 honours
    `loss_agg_mode`, default token-mean; the paper's GSPO is `seq-mean-token-mean`).

    Sequence ratio `log s_i = sum_t m*(lp - lp_old) / |y_i|` (|y_i| = valid tokens, at least 1).
    Token ratio `s_it = exp(min(sg(log s_i) + lp - sg(lp), 10))`: its value is `s_i` for every
    token, its gradient is `s_i * grad lp_t`. Then PPO's clip (no dual clip). With a per-response
    advantage and `seq-mean-token-mean` aggregation the gradient is GSPO's
    `s_i * A_i * mean_t grad lp_t`, and the whole sequence is clipped or not; with token-mean
    each sequence weighs by its length.
    Metrics as `ppo` (the clip is on `s_i`, so `clipfrac_*` count tokens of clipped sequences).
    """
    _check_eps(eps_low, eps_high)
    ok, zero, logp, old_logp, a, w = _prepare(logp, old_logp, adv, mask, weights)
    diff = logp - old_logp
    log_seq_ratio = masked_sum(diff, ok, dim=-1) / count(ok, dim=-1, dtype=diff.dtype).clamp(min=1)
    log_ratio = logp - logp.detach() + log_seq_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
    loss, clip_active = _clipped_surrogate(ratio, a, eps_low, eps_high)
    upper = metric_mean(clip_active & (a > 0), ok)
    lower = metric_mean(clip_active & (a < 0), ok)
    metrics = {
        "clipfrac": upper + lower,
        "clipfrac_upper": upper,
        "clipfrac_lower": lower,
        "approx_kl": metric_mean(-torch.clamp(diff, -20.0, 20.0), ok),
    }
    return _finish(loss, ok, zero, w), metrics


def cispo(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
          eps_low: Optional[float], eps_high: Optional[float],
          *, weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO per token: `L = -sg(clip(r, 1-eps_low, 1+eps_high)) * A * lp`.

    The clipped ratio is a constant weight, so every token keeps a REINFORCE gradient
    `-clip(r) * A * grad lp` (no token is dropped, unlike PPO). `eps_low=None` (MiniMax-M1's
    canonical form) or `eps_high=None` removes that bound; a large `eps_high` such as 4 (upper
    bound 5) is common. The clip applies whatever the sign of A.
    Metrics: `clipfrac_upper` (r > 1+eps_high), `clipfrac_lower` (r < 1-eps_low), `clipfrac`
    (their sum = verl's `pg_clipfrac`), `approx_kl`.
    """
    if (eps_low is not None and eps_low < 0) or (eps_high is not None and eps_high < 0):
        raise ValueError(f"eps_low and eps_high must be >= 0 or None, got {eps_low}, {eps_high}")
    ok, zero, logp, old_logp, a, w = _prepare(logp, old_logp, adv, mask, weights)
    log_ratio = torch.clamp(logp - old_logp, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    lo = None if eps_low is None else 1.0 - eps_low
    hi = None if eps_high is None else 1.0 + eps_high
    weight = (ratio if lo is None and hi is None else torch.clamp(ratio, min=lo, max=hi)).detach()
    loss = -weight * a * logp
    above = ratio > hi if hi is not None else torch.zeros_like(ok)
    below = ratio < lo if lo is not None else torch.zeros_like(ok)
    upper, lower = metric_mean(above, ok), metric_mean(below, ok)
    metrics = {
        "clipfrac": upper + lower,
        "clipfrac_upper": upper,
        "clipfrac_lower": lower,
        "approx_kl": metric_mean(-log_ratio, ok),
    }
    return _finish(loss, ok, zero, w), metrics


def sapo(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
         tau_pos: float = 1.0, tau_neg: float = 1.05,
         *, weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO per token: `L = -sigmoid(tau*(r-1)) * (4/tau) * A`; aggregate with `seq-mean-token-mean`.

    `tau = tau_pos` where A > 0, else `tau_neg`. The gate replaces the hard clip by a smooth
    trust region: the gradient `-A * 4*g*(1-g) * r * grad lp` (g the sigmoid) equals the
    policy gradient `-A grad lp` at r = 1 and decays as r leaves 1.
    Metrics: `approx_kl`, and `gate_mean`, the mean of `sigmoid(tau*(r-1)) * 4/tau`.
    """
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"tau_pos and tau_neg must be > 0, got {tau_pos}, {tau_neg}")
    ok, zero, logp, old_logp, a, w = _prepare(logp, old_logp, adv, mask, weights)
    log_ratio = torch.clamp(logp - old_logp, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    tau = torch.where(a > 0, torch.full_like(a, tau_pos), torch.full_like(a, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    metrics = {"approx_kl": metric_mean(-log_ratio, ok), "gate_mean": metric_mean(gate, ok)}
    return _finish(-gate * a, ok, zero, w), metrics


def gpg(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
        *, weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG per token: `L = -A * lp` (no ratio, no clip: the on-policy policy gradient).

    `old_logp` is read for the `approx_kl` metric only (verl's `gpg` returns no metric).
    """
    ok, zero, logp, old_logp, a, w = _prepare(logp, old_logp, adv, mask, weights)
    metrics = {"approx_kl": metric_mean(-torch.clamp(logp - old_logp, -20.0, 20.0), ok)}
    return _finish(-a * logp, ok, zero, w), metrics


def _dppo(logp, old_logp, adv, mask, eps_low, eps_high, clip_c, weights, keep_fn):
    _check_eps(eps_low, eps_high)
    if clip_c is not None and not clip_c > 0:
        raise ValueError(f"clip_c (IS truncation) must be > 0 or None, got {clip_c}")
    ok, zero, logp, old_logp, a, w = _prepare(logp, old_logp, adv, mask, weights)
    log_ratio = torch.clamp(logp - old_logp, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    truncated = (ratio if clip_c is None else torch.clamp(ratio, max=clip_c)).detach()
    p, p_old = torch.exp(logp.detach()), torch.exp(old_logp)
    keep = keep_fn(p, p_old, a > 0)
    loss = torch.where(keep, -a * truncated * logp, zero)
    truncated_tokens = (ratio > clip_c) & keep if clip_c is not None else torch.zeros_like(ok)
    metrics = {"clipfrac": metric_mean(~keep, ok), "truncfrac": metric_mean(truncated_tokens, ok),
               "approx_kl": metric_mean(-log_ratio, ok)}
    return _finish(loss, ok, zero, w), metrics


def dppo_tv(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
            eps_low: float, eps_high: float, clip_c: Optional[float] = 3.0,
            *, weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-TV per token: `L = -A * sg(min(r, clip_c)) * lp` on kept tokens, 0 on dropped ones.

    With `p = exp(lp)`, `p_old = exp(lp_old)`: a token with A > 0 is kept while
    `p - p_old <= eps_high`, one with A <= 0 while `p - p_old >= -eps_low` (here `eps_*` are
    total-variation thresholds on the sampled token's probability, not ratio clips). `clip_c`
    truncates the IS weight (verl reads `clip_ratio_c`, default 3; None: no truncation).
    Metrics: `clipfrac` (dropped tokens), `truncfrac` (kept tokens whose r > clip_c), `approx_kl`.
    """
    def keep(p, p_old, positive):
        return torch.where(positive, p - p_old <= eps_high, p - p_old >= -eps_low)

    return _dppo(logp, old_logp, adv, mask, eps_low, eps_high, clip_c, weights, keep)


def dppo_kl(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
            eps_low: float, eps_high: float, clip_c: Optional[float] = 3.0,
            *, weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-KL per token: as `dppo_tv`, with the binary KL as the divergence.

    `D = p_old*(lp_old - lp) + (1-p_old)*log((1-p_old+1e-8)/(1-p+1e-8))`, the KL between the
    Bernoulli distributions "sampled token or not". A > 0: kept while `D <= eps_high` or
    `p <= p_old`; A <= 0: kept while `D <= eps_low` or `p >= p_old` (only moves away from the
    advantage's direction are bounded).
    """
    def keep(p, p_old, positive):
        lp, lp_old = torch.log(p.clamp(min=1e-30)), torch.log(p_old.clamp(min=1e-30))
        d = p_old * (lp_old - lp) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
        return torch.where(positive, (d <= eps_high) | (p <= p_old), (d <= eps_low) | (p >= p_old))

    return _dppo(logp, old_logp, adv, mask, eps_low, eps_high, clip_c, weights, keep)


def _covariance(a: torch.Tensor, logp: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """`(A - mean A) * (lp - mean lp)` per token, means over the valid tokens of the call, detached."""
    lp = logp.detach()
    return (a - metric_mean(a, ok)) * (lp - metric_mean(lp, ok))


def clip_cov(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
             eps_low: float, eps_high: float, ratio: float = 0.0002, cov_low: float = 1.0, cov_high: float = 5.0,
             *, generator: Optional[torch.Generator] = None,
             weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov per token: PPO's clipped surrogate, with the gradient of a few tokens cut.

    `cov_t = (A_t - mean A) * (lp_t - mean lp)` over the valid tokens of the call. Candidates are
    valid tokens PPO's clip leaves alone with `cov_low < cov_t < cov_high`; `max(int(ratio * N), 1)`
    of them (N valid tokens), drawn at random (`generator`), get loss 0 (no gradient). No dual
    clip. Metrics: `clipfrac` (cut tokens, verl's `pg_clipfrac`), `approx_kl`.
    """
    _check_eps(eps_low, eps_high)
    if not ratio > 0:
        raise ValueError(f"ratio must be > 0, got {ratio}")
    ok, zero, logp, old_logp, a, w = _prepare(logp, old_logp, adv, mask, weights)
    log_ratio = torch.clamp(logp - old_logp, -20.0, 20.0)
    loss, clip_active = _clipped_surrogate(torch.exp(log_ratio), a, eps_low, eps_high)
    cov = _covariance(a, logp, ok)
    candidate = ok & ~clip_active & (cov > cov_low) & (cov < cov_high)
    idx = torch.nonzero(candidate.reshape(-1)).squeeze(-1)
    n_cut = min(max(int(ratio * int(ok.sum())), 1), idx.numel())
    if n_cut < idx.numel():
        perm = torch.randperm(idx.numel(), generator=generator, device="cpu").to(idx.device)
        idx = idx[perm[:n_cut]]
    cut = torch.zeros(ok.numel(), dtype=torch.bool, device=ok.device)
    cut[idx] = True
    cut = cut.view(ok.shape)
    metrics = {"clipfrac": metric_mean(cut, ok), "approx_kl": metric_mean(-log_ratio, ok)}
    return _finish(torch.where(cut, zero, loss), ok, zero, w), metrics


def kl_cov(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
           ratio: float = 0.0002, kl_coef: float = 1.0,
           *, weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov per token: `L = -A * r`, plus `kl_coef * |lp - lp_old|` on the top-covariance tokens.

    The `max(1, int(N * ratio))` valid tokens with the largest `cov_t` (as `clip_cov`; ties to the
    earlier token) get the KL penalty; no clip anywhere. Metrics: `abs_kl` (mean |lp - lp_old|,
    verl's `ppo_kl` for this loss), `klfrac` (penalised tokens).
    """
    if not ratio > 0:
        raise ValueError(f"ratio must be > 0, got {ratio}")
    ok, zero, logp, old_logp, a, w = _prepare(logp, old_logp, adv, mask, weights)
    log_ratio = torch.clamp(logp - old_logp, -20.0, 20.0)
    loss = -a * torch.exp(log_ratio)
    cov = torch.where(ok, _covariance(a, logp, ok), torch.full_like(a, -torch.inf)).reshape(-1)
    n_valid = int(ok.sum())
    picked = torch.zeros(ok.numel(), dtype=torch.bool, device=ok.device)
    if n_valid:
        k = max(1, int(n_valid * ratio))
        order = torch.sort(cov, descending=True, stable=True).indices[:k]
        picked[order] = True
    picked = picked.view(ok.shape)
    loss = torch.where(picked, loss + kl_coef * log_ratio.abs(), loss)
    metrics = {"abs_kl": metric_mean(log_ratio.abs(), ok), "klfrac": metric_mean(picked, ok)}
    return _finish(loss, ok, zero, w), metrics


def geo_mean(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
             eps_low: float, eps_high: float,
             *, weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO per token; aggregate with `seq-mean-token-mean` (its sequence loss on every token).

    Token log-ratios `d_t = lp_t - lp_old_t` are clipped to `[-eps_low, eps_high]` (log space)
    pessimistically: `d'_t = sgn(A_t) * min(sgn(A_t) d_t, sgn(A_t) clip(d_t))`. Sequence ratio
    `R_i = exp(mean_t d'_t)`, sequence advantage `A_i = mean_t A_t`, sequence loss
    `-A_i * R_i`, times the geometric mean of the correction `weights` over the sequence when
    given. The per-token output repeats the sequence loss, so `seq-mean-token-mean` with
    `global_sequences` = the number of rows (`ALL_ROWS_LOSSES`) is verl 0.9.1's mean over all
    rows, fully masked ones (loss 0) included; over the mini-batch, where verl's is over each
    micro-batch.
    Metrics: `clipfrac_upper` (A > 0, token clipped), `clipfrac_lower` (A < 0), `approx_kl`.
    """
    _check_eps(eps_low, eps_high)
    ok, zero, logp, old_logp, a, w = _prepare(logp, old_logp, adv, mask, weights)
    d = logp - old_logp
    d_clip = torch.clamp(d, -eps_low, eps_high)
    sgn = torch.sign(a)
    d_min = sgn * torch.minimum(sgn * d, sgn * d_clip)
    n = count(ok, dim=-1, dtype=d.dtype)
    seq_ratio = torch.exp(masked_sum(d_min, ok, dim=-1) / (n + 1e-8))
    seq_adv = masked_sum(a, ok, dim=-1) / (n + 1e-8)
    seq_loss = -seq_adv * seq_ratio
    if w is not None:
        log_w = torch.where(ok, torch.log(w + 1e-10), zero)
        seq_loss = seq_loss * torch.exp(log_w.sum(-1) / (n + 1e-8))
    clipped = d != d_clip
    metrics = {"clipfrac_upper": metric_mean(clipped & (a > 0), ok), "clipfrac_lower": metric_mean(clipped & (a < 0), ok),
               "approx_kl": metric_mean(-torch.clamp(d, -20.0, 20.0), ok)}
    return _finish(seq_loss.unsqueeze(-1).expand(ok.shape), ok, zero, None), metrics


def dro(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, beta: float = 0.1,
        *, weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DRO per token: `L = -(A * lp - beta/2 * (lp - lp_old)^2)`.

    The quadratic penalty keeps the update near the sampling policy without a clip (`beta` > 0,
    verl's `dro_beta`); the log-ratio is not clamped. Metrics: `approx_kl`, `sq_log_ratio`.
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    ok, zero, logp, old_logp, a, w = _prepare(logp, old_logp, adv, mask, weights)
    d = logp - old_logp
    loss = -(a * logp - 0.5 * beta * d * d)
    metrics = {"approx_kl": metric_mean(-d, ok), "sq_log_ratio": metric_mean(d * d, ok)}
    return _finish(loss, ok, zero, w), metrics


def reinforce(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
              is_level: Optional[str] = None, is_threshold=2.0, is_mode: str = "truncate",
              *, is_mask: Optional[torch.Tensor] = None,
              weights: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE per token with IS weights to the sampling policy: `L = -sg(w) * A * lp`.

    verl's `bypass_mode` with `loss_type = reinforce`, where `old_logp` is the rollout engine's
    log-prob. `w = correction.weights(lp, lp_old, is_mask, is_level, is_threshold, is_mode)` from
    the *current* log-probs (token or sequence level, truncated or masked); `is_level=None`: w = 1.
    `is_mask` (default `mask`) is the response mask before rejection sampling: verl 0.9.1's
    `compute_policy_loss_bypass_mode` computes the weights over it and rejects afterwards, so a
    sequence weight sums the log ratios of rejected tokens too. `weights` multiply the loss as in
    every loss. No clip. Metrics: `approx_kl` (to the sampling policy), `is_weight_mean`.
    """
    from .correction import weights as is_weights

    raw_logp, raw_old = logp.detach(), old_logp.detach()
    ok, zero, logp, old_logp, a, w = _prepare(logp, old_logp, adv, mask, weights)
    if is_level is None:
        iw = torch.ones_like(logp)
    else:
        if is_mask is not None and is_mask.shape != ok.shape:
            raise ValueError(f"is_mask must be [B,T] like mask {tuple(ok.shape)}, got {tuple(is_mask.shape)}")
        full = ok if is_mask is None else valid(is_mask) | ok
        iw = is_weights(raw_logp, raw_old.to(raw_logp.dtype), full, is_level, is_threshold, is_mode)
    metrics = {"approx_kl": metric_mean(-torch.clamp(logp - old_logp, -20.0, 20.0), ok),
               "is_weight_mean": metric_mean(iw, ok)}
    return _finish(-iw * a * logp, ok, zero, w), metrics
