"""Engine callbacks of the actor and the critic: model output of a packed micro-batch -> loss or
per-token values. Algorithms come from `mrl.algos`; only the plumbing lives here.

- `actor_outputs`: log-probs (and entropy) of the response tokens from TP-sharded logits
  through `mrl_kernels.logprob_entropy` (vocabulary-parallel with `group=`; the vocabulary is
  never gathered). Under context parallelism the kernel runs on this rank's tokens and the
  `[N]` results are all-gathered over CP (`MicroBatch.gather`): vocabulary- and
  context-parallel at once, and every loss below sees whole responses.
- `PolicyObjective`: policy loss (`mrl.algos.config.POLICY_LOSSES`) aggregated with the global counts,
  plus the optional KL loss to the reference and entropy bonus.
- `PairwiseObjective`: a loss over pairs of responses (online DPO, `mrl.algos.dpo`) from
  per-row coefficients computed before the pass (its docstring has why this is exact).
- `values_output` / `ValueObjective`: a value head's `[1, T, 1]` output read at the same
  positions as the log-probs (the state before each response token), clipped value loss.

Every callback reads the model output through `mb.take`: the engine runs the output layer at
the response positions only (`mrl.models.head.at_rows`), so the logits are `[1, N, V/tp]`.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from mrl.engine.engine import Totals
from mrl.engine.packing import MicroBatch

__all__ = ["actor_outputs", "PolicyObjective", "PairwiseObjective", "values_output", "ValueObjective"]


def _tp_group():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None


JOB_GROUP = object()   # a `group` default: the job's tensor-parallel group (`_tp_group()`)


def response_logprobs(logits: torch.Tensor, mb: MicroBatch, temperature: float = 1.0,
                      entropy: bool = True, vocab_size: Optional[int] = None,
                      kernels: str = "auto", group=JOB_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """`(logp [N], entropy [N])` of the response tokens of `mb` from logits `[1, T, V/tp]` (or `[1, N, V/tp]`
    when the engine ran the LM head at the response rows only, `MicroBatch.head_rows`).

    `vocab_size`: the tokenizer's vocabulary; Megatron's padding columns beyond it are masked
    out so they take no probability mass (None: no padding to mask). `kernels`: "auto" (Triton
    on CUDA) or "torch" (the twins; `model.use_fused_kernels = false`). `group`: the vocabulary's
    tensor-parallel group (default the job's; None: whole on this rank; a teacher's of its own).
    """
    import mrl_kernels

    rows = mb.take(logits)  # [N, V/tp]
    group = _tp_group() if group is JOB_GROUP else group
    if vocab_size is not None:
        from mrl.models.roles import mask_padded_vocab

        rows = mask_padded_vocab(rows, vocab_size, tp_rank=torch.distributed.get_rank(group) if group else 0)
    logp, ent = mrl_kernels.logprob_entropy(rows, mb.response_labels, temperature, group=group, backend=kernels)
    return mb.gather(logp), mb.gather(ent)


def sum_pi_squared(logits: torch.Tensor, mb: MicroBatch, temperature: float = 1.0,
                   vocab_size: Optional[int] = None) -> torch.Tensor:
    """`sum_v pi_v^2` [N] of the response tokens' next-token distributions (the optimal token
    baseline's variance proxy), from TP-sharded logits: max and the two sums of exponentials are
    reduced over the TP group, the vocabulary is never gathered."""
    rows = mb.take(logits)
    group = _tp_group()
    if vocab_size is not None:
        from mrl.models.roles import mask_padded_vocab

        rows = mask_padded_vocab(rows, vocab_size, tp_rank=torch.distributed.get_rank(group) if group else 0)
    with torch.no_grad():
        z = rows.float() / temperature
        top = z.amax(dim=-1)
        if group is not None:
            torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=group)
        e = torch.exp(z - top.unsqueeze(-1))
        sums = torch.stack([e.sum(-1), (e * e).sum(-1)])
        if group is not None:
            torch.distributed.all_reduce(sums, group=group)
        return mb.gather(sums[1] / sums[0].square())


def actor_outputs(temperature: float = 1.0, entropy: bool = False, vocab_size: Optional[int] = None,
                  kernels: str = "auto", pi_squared: bool = False, group=JOB_GROUP):
    """An `OutputFn` giving `logprobs` (and `entropy`, and `sum_pi_squared` for the optimal token
    baselines) per response token (old-policy and reference passes); `group` as `response_logprobs`'."""

    def fn(logits: torch.Tensor, mb: MicroBatch) -> dict[str, torch.Tensor]:
        logp, ent = response_logprobs(logits, mb, temperature, vocab_size=vocab_size, kernels=kernels, group=group)
        out = {"logprobs": logp, "entropy": ent} if entropy else {"logprobs": logp}
        if pi_squared:
            out["sum_pi_squared"] = sum_pi_squared(logits, mb, temperature, vocab_size)
        return out

    return fn


@dataclasses.dataclass(frozen=True)
class PolicyObjective:
    """The actor's `LossFn`. Reads `old_logprobs`, `advantages` and `response_mask` (plus
    `ref_logprobs` with a KL loss and `correction_weights` when present) from the micro-batch.

    Without `old_logprobs` the update is on-policy (one optimizer step on the weights that
    generated the responses): the old log-probs are this forward's own, detached. `record(mb,
    logprobs)` receives each micro-batch's detached log-probs (the trainer side of the audit)."""

    loss: str = "ppo"                     # mrl.algos.config.POLICY_LOSSES
    eps_low: float = 0.2
    eps_high: float = 0.2
    clip_c: Optional[float] = 3.0         # ppo dual clip, dppo IS truncation; None = off
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    kl_cov_coef: float = 0.1
    dro_beta: float = 0.1
    is_level: Optional[str] = None        # reinforce: IS weights to the rollout policy (token | sequence)
    is_threshold: object = 2.0            # reinforce: C (truncate) or (lo, hi) (mask)
    is_mode: str = "truncate"
    aggregation: str = "token-mean"
    norm: Optional[float] = None          # seq-mean-token-sum-norm divisor
    entropy_coef: float = 0.0
    kl_coef: float = 0.0                  # > 0: KL loss to the reference (GRPO style)
    kl_estimator: str = "k3"
    temperature: float = 1.0
    vocab_size: Optional[int] = None      # mask Megatron's vocabulary padding beyond it
    kernels: str = "auto"                 # "torch": the twins (model.use_fused_kernels = false)
    record: Optional[Callable] = dataclasses.field(default=None, compare=False)
    distill_coef: float = 0.0             # > 0: + coef * full-vocabulary reverse KL to the teacher
    teacher_rows: Optional[Callable] = dataclasses.field(default=None, compare=False)   # mb -> [N, V/tp] logits

    def __call__(self, logits: torch.Tensor, mb: MicroBatch, totals: Totals):
        from mrl.algos import kl, losses

        logp_flat, ent_flat = response_logprobs(logits, mb, self.temperature, vocab_size=self.vocab_size,
                                                kernels=self.kernels)
        logp, ent = mb.to_padded(logp_flat), mb.to_padded(ent_flat)
        if self.record is not None:
            self.record(mb, logp.detach())
        b = mb.batch
        mask = b["response_mask"]
        weights = b.get("correction_weights")
        old = b.get("old_logprobs")
        if old is None:
            old = logp.detach()
        if self.loss == "ppo":
            per_token, metrics = losses.ppo(logp, old, b["advantages"], mask, self.eps_low,
                                            self.eps_high, self.clip_c, weights=weights)
        elif self.loss == "gspo":
            per_token, metrics = losses.gspo(logp, old, b["advantages"], mask, self.eps_low,
                                             self.eps_high, weights=weights)
        elif self.loss == "cispo":
            per_token, metrics = losses.cispo(logp, old, b["advantages"], mask, self.eps_low,
                                              self.eps_high, weights=weights)
        elif self.loss == "sapo":
            per_token, metrics = losses.sapo(logp, old, b["advantages"], mask, self.sapo_tau_pos,
                                             self.sapo_tau_neg, weights=weights)
        else:
            per_token, metrics = self._more(logp, old, b["advantages"], mask, weights, mb)
        mode = losses.FORCED_AGG_MODE.get(self.loss, self.aggregation)

        def agg(x, sequences=totals.sequences):
            return losses.aggregate(x, mask, mode, self.norm, totals.tokens, global_sequences=sequences)

        all_rows = self.loss in losses.ALL_ROWS_LOSSES   # verl's geo_mean: mean over every row
        total = agg(per_token, totals.rows) if all_rows else agg(per_token)
        metrics = {f"pg_{k}": v for k, v in metrics.items()}
        metrics["pg_loss"] = total.detach() * _share(mb, totals, mode, all_rows)
        valid = mask > 0
        metrics["entropy"] = (ent * valid).sum() / valid.sum().clamp(min=1)
        if self.entropy_coef:
            total = total - self.entropy_coef * agg(ent)
        if self.kl_coef:
            kl_tok = kl.estimate(logp, b["ref_logprobs"], self.kl_estimator)
            total = total + self.kl_coef * agg(kl_tok)
            metrics["kl_loss"] = (kl_tok.detach() * valid).sum() / valid.sum().clamp(min=1)
        if self.distill_coef:
            total = total + self.distill_coef * agg(self._distill_kl(logits, mb, valid, metrics))
        return total, metrics

    def _distill_kl(self, logits, mb: MicroBatch, valid, metrics) -> torch.Tensor:
        """`[n, R]` the full-vocabulary reverse KL to the teacher at each response token
        (`mrl.engine.distill_kl`); its mean over valid tokens goes to `metrics["distill_kl"]`."""
        from mrl.engine.distill_kl import reverse_kl

        rows = mb.take(logits)
        group = _tp_group()
        if self.vocab_size is not None:
            from mrl.models.roles import mask_padded_vocab

            rows = mask_padded_vocab(rows, self.vocab_size, tp_rank=torch.distributed.get_rank(group) if group else 0)
        kl_tok = mb.to_padded(mb.gather(reverse_kl(rows, self.teacher_rows(mb), self.temperature, group)))
        metrics["distill_kl"] = (kl_tok.detach() * valid).sum() / valid.sum().clamp(min=1)
        return kl_tok


    def _more(self, logp, old, adv, mask, weights, mb: MicroBatch):
        """The losses after verl's first four (gpg, dppo_*, *_cov, geo_mean, dro, reinforce)."""
        from mrl.algos import losses

        if self.loss == "gpg":
            return losses.gpg(logp, old, adv, mask, weights=weights)
        if self.loss in ("dppo_tv", "dppo_kl"):
            return getattr(losses, self.loss)(logp, old, adv, mask, self.eps_low, self.eps_high, self.clip_c,
                                              weights=weights)
        if self.loss == "clip_cov":
            gen = torch.Generator().manual_seed(int(mb.batch["group_index"].sum()) if len(mb.batch) else 0)
            return losses.clip_cov(logp, old, adv, mask, self.eps_low, self.eps_high, self.clip_cov_ratio,
                                   self.clip_cov_lb, self.clip_cov_ub, generator=gen, weights=weights)
        if self.loss == "kl_cov":
            return losses.kl_cov(logp, old, adv, mask, self.kl_cov_ratio, self.kl_cov_coef, weights=weights)
        if self.loss == "geo_mean":
            return losses.geo_mean(logp, old, adv, mask, self.eps_low, self.eps_high, weights=weights)
        if self.loss == "dro":
            return losses.dro(logp, old, adv, mask, self.dro_beta, weights=weights)
        if self.loss == "reinforce":
            # bypass: `old` is the rollout engine's; the IS weights to it, from the current log-probs,
            # replace the precomputed correction weights (applying both would count the ratio twice);
            # they span the response as it was before rejection sampling, as verl's
            return losses.reinforce(logp, old, adv, mask, self.is_level, self.is_threshold, self.is_mode,
                                    is_mask=mb.batch.get("unrejected_mask"))
        raise ValueError(f"unknown policy loss {self.loss!r}")


@dataclasses.dataclass(frozen=True)
class PairwiseObjective:
    """The actor's `LossFn` for a loss over pairs of responses (online DPO: `mrl.algos.dpo`).

    A pair's loss is a function of two sequence log-probs, and a pair's rows can land in
    different micro-batches (token-balanced packing) though never on different DP ranks (pairs
    are formed within a prompt's group, and groups are rank-local). The update is therefore
    two passes over each mini-batch (`mrl.train.dpo`): a no-grad pass at the current weights
    gives every row's sequence log-prob `S_i`; `mrl.algos.dpo.row_coefficients` evaluates the
    mean pair loss `L` over the global pair count and `c_i = dL/dS_i` (column `dpo_coef`), and
    each row's part of `L` (`dpo_loss`). This pass then backpropagates
    `sum_i c_i * (S_i - S_i.detach()) + dpo_loss_i` over the micro-batch's rows: by the chain
    rule `dL/dtheta = sum_i c_i dS_i/dtheta`, a sum over rows that any split into micro-batches
    and DP ranks adds up to the same value, and the loss reported is `L` itself. The two passes
    see the same weights; `pass_drift` (the mean |S_i - S_i of the first pass|) measures the
    numerics between them."""

    temperature: float = 1.0
    vocab_size: Optional[int] = None
    kernels: str = "auto"
    record: Optional[Callable] = dataclasses.field(default=None, compare=False)

    def __call__(self, logits: torch.Tensor, mb: MicroBatch, totals: Totals):
        from mrl.algos.dpo import sequence_logps

        logp_flat, _ = response_logprobs(logits, mb, self.temperature, vocab_size=self.vocab_size,
                                         kernels=self.kernels)
        logp = mb.to_padded(logp_flat)
        if self.record is not None:
            self.record(mb, logp.detach())
        b = mb.batch
        seq = sequence_logps(logp.float(), b["response_mask"])   # float64
        coef = b["dpo_coef"].to(seq)
        total = (coef * (seq - seq.detach())).sum() + b["dpo_loss"].to(seq).sum()
        drift = (seq.detach() - b["dpo_seq_logp"].to(seq)).abs().mean() if len(b) else seq.new_zeros(())
        return total.float(), {"pass_drift": drift.float()}


def _share(mb: MicroBatch, totals: Totals, mode: str, all_rows: bool = False) -> torch.Tensor:
    """Factor turning a micro-batch's share of a global mean into a mean over the micro-batch
    (metrics are token-weighted means of per-micro-batch means); `all_rows`: a mean over rows."""
    if mode in ("token-mean", "token-sum"):
        return totals.tokens / max(mb.loss_tokens, 1)
    if all_rows:
        return totals.rows / max(len(mb.batch), 1)
    non_empty = int(((mb.batch["response_mask"] > 0).sum(-1) > 0).sum())
    return totals.sequences / max(non_empty, 1)


def values_output():
    """An `OutputFn` giving `values` per response token from a value head `[1, T, 1]` (`[1, N, 1]`)."""

    def fn(output: torch.Tensor, mb: MicroBatch) -> dict[str, torch.Tensor]:
        return {"values": mb.gather(mb.take(output)[..., 0])}

    return fn


@dataclasses.dataclass(frozen=True)
class ValueObjective:
    """The critic's `LossFn`: clipped value loss against `returns`, relative to `values` (the
    critic's pass before the update)."""

    clip_eps: Optional[float] = 0.5
    aggregation: str = "token-mean"
    norm: Optional[float] = None

    def __call__(self, output: torch.Tensor, mb: MicroBatch, totals: Totals):
        from mrl.algos import losses

        v = mb.to_padded(mb.gather(mb.take(output)[..., 0].float()))
        b = mb.batch
        loss, metrics = losses.value(v, b["values"], b["returns"], b["response_mask"], self.clip_eps,
                                     self.aggregation, norm=self.norm, global_tokens=totals.tokens,
                                     global_sequences=totals.sequences)
        metrics = {f"vf_{k.removeprefix('vf_')}": m for k, m in metrics.items()}
        metrics["vf_loss"] = loss.detach() * _share(mb, totals, self.aggregation)
        return loss, metrics
