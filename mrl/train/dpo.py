"""The actor update of online DPO (`algorithm.objective = "dpo"`, docs/algorithms.md).

Per mini-batch (the plan's, whole prompts, so every pair's two rows are in it and on this
rank): pairs from the scores of each group (`mrl.algos.dpo.preference_pairs`); a no-grad pass
at the current weights for every row's sequence log-prob; the pair count summed over the
data-parallel ranks; each row's coefficient `dL/dS_i` (`mrl.algos.dpo.row_coefficients`); then
the engine's forward/backward with `mrl.engine.objectives.PairwiseObjective` and one guarded
optimizer step. A mini-batch without a pair on any rank takes no optimizer step (an Adam step
on zero gradients would still move the weights); `dpo/skipped_updates` counts them.
"""
from __future__ import annotations

import torch

from mrl.batch import Batch
from mrl.platform.collectives import dp_sum
from mrl.train.parts import Learner, Run

__all__ = ["mini_batch", "update"]


def mini_batch(engine, mini: Batch, cfg, objective, apply, *, logprob_budget: int,
               chosen: torch.Tensor, rejected: torch.Tensor, pairs: float):
    """One mini-batch of online DPO on this rank: the no-grad pass for every row's sequence
    log-prob `S_i` (eval mode, `objective`'s temperature and kernels), the coefficients `dL/dS_i`
    of the mean loss over the `pairs` of every DP rank, then `apply(batch, objective)` (the
    engine's `train_mini_batch` or `forward_backward`) on the mini-batch with `dpo_coef`,
    `dpo_loss` and `dpo_seq_logp` added. Returns `(apply's result, pair metric sums, logp)`."""
    from mrl.algos import dpo

    logp = logprobs_of_batch(engine, mini, objective, logprob_budget)
    mask = mini["response_mask"]
    seq = dpo.sequence_logps(logp, mask)
    ref = dpo.sequence_logps(mini["ref_logprobs"], mask) if dpo.uses_reference(cfg.loss) else None
    coef, share, sums = dpo.row_coefficients(seq, ref, (mask > 0).sum(-1), chosen, rejected, pairs, cfg.loss,
                                             cfg.beta, cfg.gamma)
    result = apply(mini.add(dpo_coef=coef, dpo_loss=share, dpo_seq_logp=seq), objective)
    return result, sums, logp


def update(run: Run, learner: Learner, batch: Batch, step: int, kernels: str, record=None) -> dict[str, float]:
    """`actor.epochs` passes over the plan's mini-batches; returns `actor/*` (engine metrics,
    means over the optimizer steps taken) and `dpo/*` (means over all pairs of the step's first
    epoch, and counts). `kernels`: the log-prob kernels ("auto" or "torch"). `record` (an `UpdateLogprobs`) receives the first pass's log-probs of an
    on-policy step (one mini-batch, one epoch: the weights that generated the responses)."""
    from mrl.algos import dpo
    from mrl.engine.objectives import PairwiseObjective

    spec, alg = run.spec, run.spec.algorithm
    cfg = alg.dpo
    engine = learner.actor
    prompts = int(batch["group_index"].max()) + 1 if len(batch) else 0
    plan = engine.mini_batch_plan(batch, mini_batches=run.plan.actor.mini_batches_of(prompts),
                                  epochs=run.plan.actor.epochs, shuffle=getattr(spec.actor, "shuffle", False), seed=0,
                                  step=step)
    objective = PairwiseObjective(temperature=spec.rollout.temperature, vocab_size=run.hf["vocab_size"],
                                  kernels=kernels)

    def apply(b, obj):
        return engine.train_mini_batch(b, obj, micro_batch_tokens=spec.actor.micro_batch_tokens, step=step)

    sums = torch.zeros(7, dtype=torch.float64)   # pairs, dropped groups, loss, margin, accuracy, chosen, rejected
    records: list[dict] = []
    skipped = 0
    audit = record is not None and len(plan) == 1
    for epoch, mini in plan:
        chosen, rejected, dropped = dpo.preference_pairs(mini["rewards"], mini["group_index"], cfg.pairs, cfg.margin)
        pairs = float(dp_sum(torch.tensor([float(len(chosen))], dtype=torch.float64), "dpo pair count"))
        first = epoch == 0
        sums[1] += dropped if first else 0
        if pairs == 0:
            skipped += 1
            if audit:   # the audit still wants the trainer's log-probs of the step
                record.logprobs = logprobs_of_batch(engine, mini, objective, spec.actor.logprob_micro_batch_tokens)
            continue
        result, m, logp = mini_batch(engine, mini, cfg, objective, apply,
                                     logprob_budget=spec.actor.logprob_micro_batch_tokens, chosen=chosen,
                                     rejected=rejected, pairs=pairs)
        records.append(result)
        if audit:
            record.logprobs = logp.clone()
        if first:
            sums += torch.tensor([len(chosen), 0, m["loss"], m["reward_margin"], m["reward_accuracy"],
                                  m["chosen_logp"], m["rejected_logp"]], dtype=torch.float64)
    total = dp_sum(sums, "dpo metrics")
    n = max(float(total[0]), 1.0)
    out = {"dpo/pairs": float(total[0]), "dpo/groups_dropped": float(total[1]), "dpo/loss": float(total[2]) / n,
           "dpo/reward_margin": float(total[3]) / n, "dpo/reward_accuracy": float(total[4]) / n,
           "dpo/chosen_logp": float(total[5]) / n, "dpo/rejected_logp": float(total[6]) / n,
           "dpo/skipped_updates": float(skipped)}
    for key in (records[0] if records else {}):
        vals = [float(r[key]) for r in records]
        out[f"actor/{key}"] = sum(vals) / len(vals)
    if records:
        out["actor/grad_norm_max"] = max(float(r["grad_norm"]) for r in records)
    out["actor/updates"] = float(len(records))
    return out


def logprobs_of_batch(engine, mini: Batch, objective, budget: int) -> torch.Tensor:
    """`[B, R]` log-probs of `mini` at the current weights (the audit of a step without pairs)."""
    from mrl.engine.objectives import actor_outputs

    return engine.forward_only(mini, actor_outputs(objective.temperature, vocab_size=objective.vocab_size,
                                                   kernels=objective.kernels), micro_batch_tokens=budget)["logprobs"].cpu()
