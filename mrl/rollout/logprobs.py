"""The distribution a rollout engine samples from, and the log-probability it reports.

Processing order (vLLM's sampler, so both engines report the same quantity):
  raw logits -> repetition penalty -> [greedy: argmax, stop here] -> / temperature
  -> min-p -> top-k -> top-p -> renormalise -> sample.

`logprobs_mode`:
- `processed_logprobs`: log-softmax of the processed logits, i.e. the log-probability of the
  token under the distribution it was actually sampled from (tokens cut by top-k/top-p/min-p
  are -inf and the rest renormalised). Without truncation and penalty this is exactly
  `log_softmax(logits / temperature)`, what the trainer's `mrl_kernels.logprob_entropy(logits,
  labels, temperature)` computes. Greedy decoding reports `log_softmax(logits)` (temperature 1).
- `raw_logprobs`: `log_softmax(logits)` of the model output before any processing; equal to
  the trainer's quantity only at temperature 1.

These functions are pure and work on any `[..., V]` logits, so the trainer can recompute the
engine's quantity from its own logits (see `mrl.rollout.audit`).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from mrl.rollout.types import Sampling


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """vLLM/CTRL repetition penalty: logits of already-seen tokens are divided by `penalty` when
    positive and multiplied by it when negative. `seen` is a bool mask shaped like `logits`."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def process_logits(logits: torch.Tensor, sampling: Sampling, seen: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 logits of the sampled distribution: penalty, temperature, min-p, top-k, top-p applied
    (cut tokens at -inf). Greedy calls return the penalised logits at temperature 1."""
    z = logits.float()
    if sampling.repetition_penalty != 1.0:
        if seen is None:
            raise ValueError("repetition_penalty needs the mask of tokens seen so far")
        z = apply_repetition_penalty(z, seen, sampling.repetition_penalty)
    if sampling.greedy:
        return z
    z = z / sampling.temperature
    neg_inf = torch.tensor(float("-inf"), dtype=z.dtype, device=z.device)
    if sampling.min_p > 0:
        probs = torch.softmax(z, dim=-1)
        keep = probs >= sampling.min_p * probs.amax(dim=-1, keepdim=True)
        z = torch.where(keep, z, neg_inf)
    if 0 < sampling.top_k < z.shape[-1]:
        kth = torch.topk(z, sampling.top_k, dim=-1).values[..., -1:]
        z = torch.where(z >= kth, z, neg_inf)  # ties with the k-th value are kept
    if sampling.top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
        keep_sorted = mass_before < sampling.top_p
        keep_sorted[..., 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        z = torch.where(keep, z, neg_inf)
    return z


def sample_rows(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row of `probs` [B, V] (non-negative, not necessarily normalised), row r drawn
    with `generators[r]` alone: the inverse CDF at one uniform u per row, in float64, i.e. the
    first token whose cumulative mass exceeds u times the row's total. A zero-probability token
    is never drawn (its cumulative mass equals its predecessor's). Equal in law to
    `torch.multinomial(probs[r], 1)` per row, which draws one exponential per vocabulary entry
    and costs about 0.8 ms per 49k-token row on a CPU core; this draws one number per row and
    does the rest batched."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    u = torch.cat([torch.rand(1, dtype=torch.float64, generator=g, device=probs.device) for g in generators])
    x = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))   # below the total
    return torch.searchsorted(cdf, x, right=True).squeeze(-1)


def reported_logprobs(logits: torch.Tensor, tokens: torch.Tensor, sampling: Sampling,
                      seen: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Log-probabilities of `tokens` ([...]) under `logits` ([..., V]) as the engine reports them
    for `sampling.logprobs_mode` (fp32, shaped like `tokens`)."""
    if sampling.logprobs_mode == "raw_logprobs":
        z = logits.float()
    else:
        z = process_logits(logits, sampling, seen)
    return torch.log_softmax(z, dim=-1).gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
