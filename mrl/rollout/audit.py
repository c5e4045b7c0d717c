"""Train/inference log-prob audit, and teacher-forced recomputation of the engine's quantity.

Every step the trainer recomputes the log-probabilities of the sampled tokens with its own model
(`old` log-probs) and calls `logprob_audit` with the engine's. On the first step both hold the same
weights, so any difference is numerical (kernels, dtype, batching); a growing mismatch is the
train/inference drift that rollout correction (mrl.algos.correction) compensates.

`teacher_forced_logprobs` recomputes what the engine reports from any model's full-sequence
logits: the trainer passes a function that runs its (Megatron) forward and returns logits; the
`hf_logits_fn` does the same with a transformers model.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from mrl.rollout.logprobs import reported_logprobs
from mrl.rollout.types import Response, Sampling

# (input_ids [B,S], attention_mask [B,S] (1 = real token, right-padded), position_ids [B,S]) -> logits [B,S,V]
LogitsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@torch.no_grad()
def logprob_audit(rollout_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mismatch between the engine's and the trainer's log-probs of the same sampled tokens.

    Inputs are `[B,T]` with `mask` 1 on response tokens the loss sees (0 on padding and tool
    output). With `d = rollout - trainer` over those tokens:
    - `rollout/logprob_abs_diff_mean`, `rollout/logprob_abs_diff_max`: mean and max of `|d|`;
    - `rollout/kl_k1`: mean of `d`, the k1 estimate of KL(pi_rollout || pi_trainer) (tokens are
      sampled from the rollout policy; unbiased but noisy, may be negative);
    - `rollout/kl_k3`: mean of `exp(-d) - 1 + d` (d clamped to ±20), the k3 estimate of the same
      KL (>= 0, low variance);
    - `rollout/prob_abs_diff_mean`: mean of `|exp(rollout) - exp(trainer)|`;
    - `rollout/log_ppl_diff`: mean over sequences of `mean_t rollout - mean_t trainer`, log(ppl_trainer
      / ppl_rollout) (`rollout/log_ppl_abs_diff`: of its absolute value);
    - `rollout/chi2_token`, `rollout/chi2_seq`: chi^2(pi_trainer || pi_rollout) per token and per
      sequence (`mrl.algos.correction.mismatch_metrics`, verl's `rollout_corr/*`): the variance of
      the importance weights rollout correction applies, the figure FP8 rollout moves most;
    - `rollout/audit_tokens`: how many tokens were compared.
    Empty input gives 0 for every metric.
    """
    if not rollout_logp.shape == trainer_logp.shape == mask.shape:
        raise ValueError(f"shapes differ: rollout {tuple(rollout_logp.shape)}, trainer {tuple(trainer_logp.shape)}, "
                         f"mask {tuple(mask.shape)}")
    ok = mask.bool()
    n = int(ok.sum())
    if n == 0:
        return {k: 0.0 for k in ("rollout/logprob_abs_diff_mean", "rollout/logprob_abs_diff_max", "rollout/kl_k1",
                                 "rollout/kl_k3", "rollout/prob_abs_diff_mean", "rollout/audit_tokens") + _SPREAD}
    roll, train = rollout_logp[ok].double(), trainer_logp[ok].double()
    d = roll - train
    dc = d.clamp(-20.0, 20.0)
    return {
        "rollout/logprob_abs_diff_mean": float(d.abs().mean()),
        "rollout/logprob_abs_diff_max": float(d.abs().max()),
        "rollout/kl_k1": float(d.mean()),
        "rollout/kl_k3": float((torch.expm1(-dc) + dc).mean()),
        "rollout/prob_abs_diff_mean": float((roll.exp() - train.exp()).abs().mean()),
        "rollout/audit_tokens": float(n),
        **_spread(rollout_logp, trainer_logp, mask),
    }


_SPREAD = ("rollout/log_ppl_diff", "rollout/log_ppl_abs_diff", "rollout/chi2_token", "rollout/chi2_seq")


def _spread(rollout_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    from mrl.algos.correction import mismatch_metrics

    m = mismatch_metrics(trainer_logp.double(), rollout_logp.double(), mask)
    return {k: float(m[k.removeprefix("rollout/")]) for k in _SPREAD}


def pack_sequences(prompts: Sequence[Sequence[int]], responses: Sequence[Response], pad_id: int = 0):
    """Right-padded `prompt + response` rows for a teacher-forced forward.

    Returns `(input_ids, attention_mask, position_ids, response_mask, rollout_logp)`; the last two
    are `[B, T]` aligned to the responses (T = longest response): `response_mask` is the
    responses' `loss_mask` (0 past their end), `rollout_logp` their engine log-probs.
    """
    seqs = [list(prompts[r.prompt_index]) + list(r.token_ids) for r in responses]
    B, S = len(seqs), max(len(s) for s in seqs)
    T = max((len(r.token_ids) for r in responses), default=0)
    ids = torch.full((B, S), pad_id, dtype=torch.long)
    attn = torch.zeros(B, S, dtype=torch.long)
    resp_mask = torch.zeros(B, T, dtype=torch.long)
    rollout = torch.zeros(B, T, dtype=torch.float32)
    for b, (s, r) in enumerate(zip(seqs, responses)):
        ids[b, :len(s)] = torch.tensor(s)
        attn[b, :len(s)] = 1
        resp_mask[b, :len(r.token_ids)] = torch.tensor(r.loss_mask)
        rollout[b, :len(r.token_ids)] = torch.tensor(r.logprobs)
    positions = torch.arange(S).expand(B, S).contiguous()
    return ids, attn, positions, resp_mask, rollout


@torch.no_grad()
def teacher_forced_logprobs(logits_fn: LogitsFn, prompts: Sequence[Sequence[int]], responses: Sequence[Response],
                            sampling: Sampling, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recompute the engine's reported log-probs of `responses` with one full forward.

    Returns `(trainer_logp, rollout_logp, mask)`, each `[B, T]`, ready for `logprob_audit`.
    The quantity is `mrl.rollout.logprobs.reported_logprobs` under `sampling` (the call's
    sampling), including the repetition-penalty history when one is set.
    """
    ids, attn, pos, resp_mask, rollout = pack_sequences(prompts, responses, pad_id)
    logits = logits_fn(ids, attn, pos)
    B, T = resp_mask.shape
    trainer = torch.zeros(B, T, dtype=torch.float32)
    for b, r in enumerate(responses):
        p, n = len(prompts[r.prompt_index]), len(r.token_ids)
        if n == 0:
            continue
        step_logits = logits[b, p - 1:p - 1 + n].float()  # the logits that predicted each response token
        tokens = torch.tensor(r.token_ids, device=step_logits.device)
        seen = None
        if sampling.repetition_penalty != 1.0:
            V = step_logits.shape[-1]
            seq = ids[b, :p + n].to(step_logits.device)
            seen = torch.zeros(n, V, dtype=torch.bool, device=step_logits.device)
            for t in range(n):  # tokens seen before response token t: prompt + response[:t]
                seen[t, seq[:p + t]] = True
        trainer[b, :n] = reported_logprobs(step_logits, tokens, sampling, seen).cpu()
    return trainer, rollout, resp_mask


def hf_logits_fn(model) -> LogitsFn:
    """A `LogitsFn` running a transformers causal LM in one full (uncached) forward."""
    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]

    def run(ids, attn, pos):
        out = model(input_ids=ids.to(device), attention_mask=attn.to(device), position_ids=pos.to(device), use_cache=False)
        return out.logits[..., :vocab]

    return run
