"""Policy and value losses, and loss aggregation.

- `ppo`: clipped surrogate of PPO (Schulman et al. 2017, arXiv:1707.06347) with optional
  dual-clip (Ye et al. 2020, arXiv:1912.09729); `eps_high > eps_low` is DAPO's clip-higher
  (Yu et al. 2025, arXiv:2503.14476).
- `gspo`: Group Sequence Policy Optimization, token-level form GSPO-token (Zheng et al. 2025,
  arXiv:2507.18071).
- `cispo`: Clipped IS-weight Policy Optimization (MiniMax-M1, 2025, arXiv:2506.13585).
- `sapo`: Soft Adaptive Policy Optimization, sigmoid-gated surrogate (Qwen team 2025,
  arXiv:2511.20347).
- `value`: clipped value loss of PPO's critic.
- `aggregate`: `loss_agg_mode` reduction (token-mean; seq-mean-token-sum; seq-mean-token-mean;
  seq-mean-token-sum-norm of Dr.GRPO, Liu et al. 2025, arXiv:2503.20783), split-invariant over
  micro-batches and data-parallel ranks when given the global counts.

Policy losses return `(per_token [B,T], metrics)`: the loss of every token *before*
aggregation, 0 at masked positions, multiplied by the rollout-correction `weights` when given;
`metrics` maps names to detached 0-dim tensors (masked means over the valid tokens of the call;
call `.item()` when logging). `adv` may be [B] (one advantage per response) or [B,T].
Masked positions of every input are replaced by 0 before use, so padding values (even NaN) reach
neither the loss nor the gradient. Ratios are `r = exp(clamp(lp - lp_old, -20, 20))`.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ._masked import broadcast_tokens, count, masked_sum, metric_mean, valid

__all__ = ["AGG_MODES", "FORCED_AGG_MODE", "ppo", "gspo", "cispo", "sapo", "aggregate", "value"]

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

FORCED_AGG_MODE = {"gspo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean"}
"""Losses whose definition fixes the aggregation (docs/algorithms.md; verl ignores loss_agg_mode for
these). A trainer aggregates `gspo`/`sapo` per-token losses with this mode, whatever is configured."""

Count = Union[int, float, torch.Tensor]


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
    """GSPO(-token) surrogate per token; aggregate it with `seq-mean-token-mean`.

    Sequence ratio `log s_i = sum_t m*(lp - lp_old) / |y_i|` (|y_i| = valid tokens, at least 1).
    Token ratio `s_it = exp(min(sg(log s_i) + lp - sg(lp), 10))`: its value is `s_i` for every
    token, its gradient is `s_i * grad lp_t`. Then PPO's clip (no dual clip). With a per-response
    advantage and `seq-mean-token-mean` aggregation the gradient is GSPO's
    `s_i * A_i * mean_t grad lp_t`, and the whole sequence is clipped or not.
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


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, norm: Optional[float] = None,
              global_tokens: Optional[Count] = None, *, global_sequences: Optional[Count] = None,
              dp_size: int = 1) -> torch.Tensor:
    """Reduce a per-token loss [B,T] to the scalar this micro-batch contributes.

    Modes (`loss_agg_mode`), with L the per-token loss and m the mask:
    - `token-mean`: `sum(m*L) / N_tok`;
    - `seq-mean-token-sum`: `sum_i sum_t m*L / N_seq`;
    - `seq-mean-token-mean`: `sum_i (sum_t m*L / sum_t m) / N_seq`;
    - `seq-mean-token-sum-norm` (Dr.GRPO): `sum_i sum_t m*L / (N_seq * norm)`; `norm` defaults
      to T, the padded width of *this* call, so pass the configured max response length when
      micro-batches are padded to different widths.
    `norm` is read only by the last mode. A fully masked sequence is in no N_seq and adds 0.

    Split invariance (micro-batches x data-parallel ranks). Without global counts, N_tok and N_seq
    are those of this call: right for one call over the whole mini-batch. When the mini-batch is
    split, every call passes `global_tokens` = valid tokens of the whole mini-batch (all
    micro-batches, all DP ranks, e.g. an all-reduce of `mask.sum()` before the micro-batch loop)
    and, for the seq-mean modes, `global_sequences` = its number of non-empty sequences, plus
    `dp_size` = the number of DP ranks. The trainer then backpropagates every call's result,
    *sums* gradients over micro-batches (no division by their number) and *averages* them over
    the DP ranks (DDP/FSDP/Megatron default); the result is multiplied by `dp_size` to cancel
    that averaging. The accumulated gradient then equals that of one call on the whole
    mini-batch. (A framework that sums gradients over DP passes dp_size=1; a pipeline schedule
    that divides each micro-batch loss by the number of micro-batches needs that factor back.)
    `dp_size > 1` without the global count the mode needs is an error. Empty input gives 0.

    A trainer's mini-batch step, per DP rank::

        n_tok = all_reduce_sum(mask.sum())                    # whole mini-batch, all ranks
        n_seq = all_reduce_sum((mask.sum(-1) > 0).sum())
        for mb in micro_batches:
            per_token, metrics = losses.ppo(lp, mb.old_logp, mb.adv, mb.mask, 0.2, 0.28, 3.0)
            loss = losses.aggregate(per_token, mb.mask, mode, norm=max_response_tokens,
                                    global_tokens=n_tok, global_sequences=n_seq, dp_size=dp)
            loss.backward()                                   # gradients add up
        # DP all-reduce averages gradients; optimizer step
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {AGG_MODES}")
    if per_token.dim() != 2 or per_token.shape != mask.shape:
        raise ValueError(f"per_token and mask must both be [B,T]; got {tuple(per_token.shape)}, {tuple(mask.shape)}")
    if int(dp_size) != dp_size or dp_size < 1:
        raise ValueError(f"dp_size must be a positive integer, got {dp_size}")
    needed, given = ("global_tokens", global_tokens) if mode == "token-mean" else ("global_sequences", global_sequences)
    if dp_size > 1 and given is None:
        raise ValueError(f"{mode} with dp_size={dp_size} needs {needed} (the count over the global mini-batch); "
                         "a per-rank count makes the loss depend on the split")
    ok = valid(mask)
    dtype, device = per_token.dtype, per_token.device

    def denominator(local: torch.Tensor, total: Optional[Count]) -> torch.Tensor:
        n = local if total is None else torch.as_tensor(total, device=device).to(dtype)
        return n.clamp(min=1)

    if mode == "token-mean":
        loss = masked_sum(per_token, ok) / denominator(count(ok, dtype=dtype), global_tokens)
        return loss * dp_size
    seq_sum = masked_sum(per_token, ok, dim=-1)
    seq_tokens = count(ok, dim=-1, dtype=dtype)
    if mode == "seq-mean-token-sum":
        per_seq = seq_sum
    elif mode == "seq-mean-token-mean":
        per_seq = seq_sum / seq_tokens.clamp(min=1)
    else:
        if norm is not None and not norm > 0:
            raise ValueError(f"norm must be > 0, got {norm}")
        per_seq = seq_sum / (float(norm) if norm is not None else float(max(per_token.shape[-1], 1)))
    non_empty = seq_tokens > 0
    total = torch.where(non_empty, per_seq, torch.zeros((), dtype=dtype, device=device)).sum()
    return total / denominator(non_empty.sum().to(dtype), global_sequences) * dp_size


def value(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
          clip_eps: Optional[float], mode: str, *, norm: Optional[float] = None,
          global_tokens: Optional[Count] = None, global_sequences: Optional[Count] = None,
          dp_size: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: `0.5 * aggregate(max((v-R)^2, (clip(v, v_old-eps, v_old+eps) - R)^2))`.

    `mode` and the keywords are those of `aggregate`. `clip_eps=None` disables the clip (plain
    `0.5*(v-R)^2`). Returns `(loss, metrics)`; `vf_clipfrac` is the fraction of valid tokens where
    the clipped term is the larger one (gradient 0 there), as verl's `vf_clipfrac`.
    """
    if values.shape != old_values.shape or values.shape != returns.shape or values.shape != mask.shape:
        raise ValueError("values, old_values, returns and mask must all be [B,T]")
    if clip_eps is not None and clip_eps < 0:
        raise ValueError(f"clip_eps must be >= 0 or None, got {clip_eps}")
    ok = valid(mask)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(ok, values, zero)
    v_old = torch.where(ok, old_values.detach().to(v.dtype), zero)
    ret = torch.where(ok, returns.detach().to(v.dtype), zero)
    unclipped = (v - ret) ** 2
    if clip_eps is None:
        per_token, clip_active = unclipped, torch.zeros_like(ok)
    else:
        clipped = (torch.clamp(v, v_old - clip_eps, v_old + clip_eps) - ret) ** 2
        per_token, clip_active = torch.maximum(unclipped, clipped), clipped > unclipped
    loss = 0.5 * aggregate(per_token, ok, mode, norm, global_tokens,
                           global_sequences=global_sequences, dp_size=dp_size)
    return loss, {"vf_clipfrac": metric_mean(clip_active, ok)}
