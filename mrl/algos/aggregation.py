"""Loss aggregation (verl's `loss_agg_mode`) and the clipped value loss of PPO's critic.

- `aggregate`: token-mean; token-sum; seq-mean-token-sum; seq-mean-token-mean;
  seq-mean-token-sum-norm of Dr.GRPO (Liu et al. 2025, arXiv:2503.20783), split-invariant over
  micro-batches and data-parallel ranks when given the global counts.
- `value`: clipped value loss of PPO's critic, aggregated the same way.

Both are re-exported by `mrl.algos.losses` (`losses.aggregate`, `losses.value`).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ._masked import count, masked_sum, metric_mean, valid

__all__ = ["AGG_MODES", "Count", "aggregate", "value"]

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

Count = Union[int, float, torch.Tensor]


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, norm: Optional[float] = None,
              global_tokens: Optional[Count] = None, *, global_sequences: Optional[Count] = None,
              dp_size: int = 1) -> torch.Tensor:
    """Reduce a per-token loss [B,T] to the scalar this micro-batch contributes.

    Modes (`loss_agg_mode`), with L the per-token loss and m the mask:
    - `token-mean`: `sum(m*L) / N_tok`;
    - `token-sum`: `sum(m*L)`, no normalisation (needs no global count; verl PR #7197 defines it the
      same way: the local masked sum times dp_size, below);
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
    if dp_size > 1 and given is None and mode != "token-sum":
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
    if mode == "token-sum":
        return masked_sum(per_token, ok) * dp_size
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
