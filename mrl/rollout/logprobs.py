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
    with `generators[r]` alone: the exponential race argmax_v probs[r, v] / E[r, v] with E[r, v] =
    -log U[r, v] i.i.d. Exp(1), which draws v with probability probs[r, v] / sum(probs[r]) (the
    algorithm of `torch.multinomial(probs[r], 1)` and of vLLM's sampler). Each row's uniforms come
    from its own generator, V of them per call; the rest is batched. A zero-probability token is
    never drawn (U is kept above 0, so every E is finite and a positive token's ratio is above 0).

    Why a race and not the inverse CDF at one uniform per row: a token is chosen by comparing
    ratios, so a change of the logits in their last bits (another batch's padding, another GEMM
    blocking) flips the draw only where two ratios are that close, with a probability of the order
    of the change. The inverse CDF compares u with cumulative sums over the whole vocabulary, whose
    changes add up over every token summed while each token's interval stays narrow: SmolLM2's
    logits of the same prompts alone and left-padded in a batch (up to 4.4e-5 apart) moved 30 of
    6000 inverse-CDF draws and none of the race's. And it is faster: V uniforms from the row's
    Mersenne twister cost less than a float64 cumulative sum and search of every row (64 rows x
    49k tokens on one core at load 20: 22 ms, against 82 ms for the inverse CDF and 158 ms for
    `torch.multinomial` per row)."""
    B, V = probs.shape
    noise = torch.empty(B, V, dtype=torch.float32, device=probs.device)
    tiny = torch.finfo(torch.float32).tiny
    for r, g in enumerate(generators):   # row r's uniforms: its generator's next V numbers, whatever the batch;
        # log per row: a batched log's vector/scalar split (by position in the batch) could move an ulp
        torch.rand(V, generator=g, device=probs.device, out=noise[r]).clamp_min_(tiny).log_()
    return torch.div(probs.float(), noise.neg_(), out=noise).argmax(dim=-1)   # E = -log U in (0, 87.4]


def reported_logprobs(logits: torch.Tensor, tokens: torch.Tensor, sampling: Sampling,
                      seen: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Log-probabilities of `tokens` ([...]) under `logits` ([..., V]) as the engine reports them
    for `sampling.logprobs_mode` (fp32, shaped like `tokens`)."""
    if sampling.logprobs_mode == "raw_logprobs":
        z = logits.float()
    else:
        z = process_logits(logits, sampling, seen)
    return torch.log_softmax(z, dim=-1).gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
