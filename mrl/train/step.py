"""One training step: the data path of docs/design.md, one line per stage.

    take the step's rollouts from the rollout source (`mrl.train.source`: produced inline when
    colocated, waited for when separate) -> to a batch (`mrl.train.batching`: + overlong shaping,
    the rollout's MoE routes) -> old log-probs (+ audit) -> reference log-probs -> critic values
    -> advantages (+ correction weights) -> critic update -> actor update -> the `moe/*` metrics

An MoE actor's passes replay routes as `actor.moe.routing_replay` says (`actor_pass`): the
old-log-prob pass and the updates, here, where they run.

Every stage is timed (`time/<stage>`); `time/rollout_share` is the rollout's share of the step.
Each stage function takes only the parts it reads (`mrl.train.parts`), so it can be called with
small fakes.
"""
from __future__ import annotations

import contextlib
import time
from typing import Optional

import torch

from mrl.batch import Batch
from mrl.platform.collectives import dp_sum
from mrl.train.batching import to_batch
from mrl.train.moe import step_metrics as moe_metrics
from mrl.train.parts import Learner, Run, SampleLog
from mrl.train.timer import StageTimer


def train_step(run: Run, learner: Learner, rollouts, step: int, on_stage=None,
               samples: Optional[SampleLog] = None, on_policy: Optional[bool] = None) -> dict[str, float]:
    """Step `step`: take its rollouts from `rollouts` (a `mrl.train.source.RolloutSource`), then learn.

    `on_policy` (default: the plan's, `mrl.train.plan.on_policy`): the old log-probs and the
    audit come from the actor update's own forward pass instead of a separate one (the update
    runs on the weights that generated the responses; the losses are the same)."""
    spec, alg = run.spec, run.spec.algorithm
    reuse = run.plan.on_policy if on_policy is None else on_policy
    t = StageTimer(on_stage)
    shard, metrics = rollouts.take(step, t)
    batch, m, rows = to_batch(run, shard, step)
    metrics.update(m)
    metrics.update(staleness([r.policy_version for r in shard.responses], step, spec.rollout.max_staleness))
    if samples is not None:
        samples.put("train", rows)
    train_started_at = time.time()
    replay = spec.actor.moe.routing_replay
    if learner.actor.routing is not None:   # MoE: a step starts its route counts afresh
        learner.actor.routing.reset()
    if not reuse:
        with t("old_logprobs"), actor_pass(learner.actor, replay, "old", batch):
            if alg.advantage in ("optimal_token_baseline", "tir_optimal_token_baseline"):
                batch = batch.add(**logprobs_of(learner.actor, run, batch, spec.actor.logprob_micro_batch_tokens,
                                                pi_squared=True))
            else:
                batch = batch.add(trainer_logprobs=logprobs_of(learner.actor, run, batch,
                                                               spec.actor.logprob_micro_batch_tokens))
            batch = batch.add(old_logprobs=batch["rollout_logprobs" if alg.correction.old_logprobs == "rollout"
                                                 else "trainer_logprobs"])
            metrics.update(audit(batch))
        batch = recorded_routes(learner.actor, replay, batch)
    elif alg.correction.old_logprobs == "rollout":
        batch = batch.add(old_logprobs=batch["rollout_logprobs"])
    if learner.ref is not None:
        with t("ref_logprobs"):
            batch = batch.add(ref_logprobs=logprobs_of(learner.ref, run, batch, spec.ref.micro_batch_tokens))
    if learner.teacher is not None and spec.distill.estimator == "sampled":
        from mrl.train.teacher import teacher_logprobs

        with t("teacher_logprobs"):
            lq, m = teacher_logprobs(learner.teacher, batch, spec.distill.micro_batch_tokens, spec.rollout.temperature,
                                     kernel_backend(run))
            batch = batch.add(teacher_logprobs=lq)
            metrics.update(m)
    if learner.critic is not None:
        with t("values"):
            batch = batch.add(values=values_of(run, learner.critic, batch))
    if alg.objective == "dpo":   # pairs instead of advantages (mrl.train.dpo)
        from mrl.train import dpo

        recorded = UpdateLogprobs(batch) if reuse else None
        with t("actor_update"):
            metrics.update(dpo.update(run, learner, batch, step, kernel_backend(run), recorded))
        metrics["tokens/actor_update"] = float(batch.sequence_lengths.sum()) * spec.actor.epochs
        if recorded is not None:
            metrics.update(audit(batch.add(trainer_logprobs=recorded.logprobs)))
        metrics.update({"time/train_started_at": train_started_at, "time/train_ended_at": time.time()})
        metrics.update(t.metrics())
        return metrics
    with t("advantages"):
        batch, m = advantages(run, learner.kl, batch, step)
        metrics.update(m)
    if learner.critic is not None:
        with t("critic_update"):
            metrics.update(update(learner.critic, batch, spec.critic, run.plan.critic, value_objective(run), step,
                                  "critic"))
    if learner.critic is None or step > spec.critic.warmup_steps:
        recorded = UpdateLogprobs(batch) if reuse else None
        with t("actor_update"), actor_pass(learner.actor, replay, "update", batch):
            metrics.update(update(learner.actor, batch, spec.actor, run.plan.actor, policy_objective(run, recorded, learner.teacher),
                                  step, "actor"))
        metrics["tokens/actor_update"] = float(batch.sequence_lengths.sum()) * spec.actor.epochs
        if recorded is not None:   # the audit from the update's forward pass
            batch = batch.add(trainer_logprobs=recorded.logprobs)
            metrics.update(audit(batch))
    metrics.update(moe_metrics(learner.actor))
    # when this step learned (wall clock: with a separate rollout, generation overlaps it)
    metrics.update({"time/train_started_at": train_started_at, "time/train_ended_at": time.time()})
    metrics.update(t.metrics())
    return metrics


class UpdateLogprobs:
    """The trainer's log-probs `[B, R]` of a batch as the actor update's forward pass computes
    them, micro-batch by micro-batch (an on-policy step's only actor forward before the update).
    The update has one mini-batch holding the batch's rows in order."""

    def __init__(self, batch: Batch):
        self.logprobs = torch.zeros(len(batch), batch.response_width)

    def __call__(self, mb, logprobs: torch.Tensor) -> None:
        self.logprobs[mb.index, :logprobs.shape[1]] = logprobs.float().cpu()


def staleness(versions: list[int], step: int, max_staleness: int) -> dict[str, float]:
    """How many policy versions the step's responses (`versions`: of each one's first token) lag
    the policy they train (step - 1). The rollout side generates step t with version
    max(0, t - 1 - max_staleness) exactly and drops partial rollouts that began earlier
    (`mrl.train.source`, `mrl.train.produce`), so a larger lag is a bug, not data to drop."""
    lags = [step - 1 - v for v in versions]
    if lags and not 0 <= min(lags) <= max(lags) <= max_staleness:
        raise RuntimeError(f"step {step} got responses lagging {min(lags)}..{max(lags)} policy versions, outside "
                           f"[0, rollout.max_staleness = {max_staleness}]")
    return {"rollout/version_lag_mean": sum(lags) / len(lags) if lags else 0.0,
            "rollout/version_lag_max": float(max(lags, default=0))}


# ---------------------------------------------------------------------------- stages

def logprobs_of(engine, run: Run, batch: Batch, budget: Optional[int], pi_squared: bool = False):
    """Per response token log-probs `[B, R]` under `engine`'s model, at the rollout temperature;
    with `pi_squared`, `{"trainer_logprobs", "sum_pi_squared"}` (the optimal token baselines')."""
    from mrl.engine.objectives import actor_outputs

    out = engine.forward_only(batch, actor_outputs(run.spec.rollout.temperature, vocab_size=run.hf["vocab_size"],
                                                   kernels=kernel_backend(run), pi_squared=pi_squared),
                              micro_batch_tokens=budget)
    if pi_squared:
        return {"trainer_logprobs": out["logprobs"].cpu(), "sum_pi_squared": out["sum_pi_squared"].cpu()}
    return out["logprobs"].cpu()


def values_of(run: Run, critic, batch: Batch) -> torch.Tensor:
    from mrl.engine.objectives import values_output

    return critic.forward_only(batch, values_output(), micro_batch_tokens=run.spec.critic.micro_batch_tokens)["values"].cpu()


def audit(batch: Batch) -> dict[str, float]:
    """Train/inference mismatch of the same tokens: the engine's log-probs vs the trainer's (equal
    weights, so on step 1 this measures numerics alone)."""
    from mrl.rollout.audit import logprob_audit

    return logprob_audit(batch["rollout_logprobs"], batch["trainer_logprobs"], batch["response_mask"])


def advantages(run: Run, kl_controller, batch: Batch, step: int = 0) -> tuple[Batch, dict]:
    """Advantages (and returns for the critic) by `algorithm.advantage`, KL in the reward when
    enabled, rollout-correction weights and rejection sampling. Whitening statistics span all DP
    ranks. Order as verl 0.9.1's trainers: token rewards (KL in the reward) and correction weights
    over the response mask as generated; then rejection (decoupled mode: before the advantages,
    which see the rejected mask; bypass, `old_logprobs = "rollout"`: after them, as verl rejects
    inside its loss); then the advantages; then PF-PPO."""
    from mrl.algos import advantages as adv
    from mrl.algos import correction, kl

    alg = run.spec.algorithm
    mask = batch["response_mask"]
    scores = batch["rewards"]
    metrics: dict[str, float] = {}
    kl_tokens, beta = None, 0.0
    if alg.kl_reward.enable:
        kl_tokens = kl.estimate(batch["old_logprobs"], batch["ref_logprobs"], alg.kl_reward.estimator)
        beta = kl_controller.value
        valid = mask > 0
        total, tokens = dp_sum(torch.stack([(kl_tokens * valid).sum(), valid.sum()]).double()).tolist()
        current = total / max(tokens, 1.0)
        metrics.update({"kl/reward_kl": current, "kl/reward_coef": beta})
        kl_controller.update(current, len(batch) * run.dp)
    token_rewards = adv.token_rewards(scores, mask, kl_tokens, beta)
    fields: dict[str, torch.Tensor] = {}
    cor = alg.correction
    if cor.level != "off":
        threshold = (cor.mask_low, cor.mask_high) if cor.mode == "mask" else cor.threshold
        fields["correction_weights"] = correction.weights(batch["trainer_logprobs"], batch["rollout_logprobs"], mask,
                                                          cor.level, threshold, cor.mode, normalize=cor.normalize,
                                                          all_reduce=dp_sum)
        metrics.update({f"correction/{k}": float(v) for k, v in correction.weight_metrics(
            batch["trainer_logprobs"], batch["rollout_logprobs"], mask, cor.level, threshold, cor.mode).items()})
    bypass = cor.old_logprobs == "rollout"
    if cor.rejection is not None and not bypass:
        batch, m = reject(batch, cor.rejection, cor.rejection_threshold)
        metrics.update(m)
        mask = batch["response_mask"]
    returns = None
    if alg.advantage == "gae":
        a, returns = adv.gae(token_rewards, batch["values"], mask, alg.gamma, alg.lam, all_reduce=dp_sum)
    elif alg.advantage == "grpo":
        a = adv.grpo(scores, batch["group_index"], norm_by_std=alg.norm_by_std).unsqueeze(1) * mask
    elif alg.advantage == "rloo":
        a = adv.rloo(scores, batch["group_index"]).unsqueeze(1) * mask
    elif alg.advantage == "reinforce_pp":
        a = adv.reinforce_pp(token_rewards, mask, alg.gamma, all_reduce=dp_sum)
    elif alg.advantage == "reinforce_pp_baseline":
        a = adv.reinforce_pp_baseline(scores, batch["group_index"], mask, all_reduce=dp_sum)
    elif alg.advantage == "remax":
        a = adv.remax(token_rewards, batch["greedy_scores"], mask)
    elif alg.advantage == "opo":
        a = adv.opo(scores, batch["group_index"], mask).unsqueeze(1) * mask
    elif alg.advantage == "grpo_passk":
        a = adv.grpo_passk(scores, batch["group_index"], norm_by_std=alg.norm_by_std).unsqueeze(1) * mask
    elif alg.advantage == "gpg":
        a = adv.gpg(scores, batch["group_index"], all_reduce=dp_sum).unsqueeze(1) * mask
    elif alg.advantage == "gdpo":
        weights = torch.tensor(alg.gdpo_reward_weights) if alg.gdpo_reward_weights else None
        a = adv.gdpo(batch["reward_components"], batch["group_index"], mask, weights, norm_by_std=alg.norm_by_std,
                     all_reduce=dp_sum)
    elif alg.advantage in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        a, _ = getattr(adv, alg.advantage)(token_rewards, mask, batch["group_index"], batch["old_logprobs"],
                                           batch["sum_pi_squared"], fields.get("correction_weights"),
                                           handle_zero_tail=True)   # as verl 0.9.1's trainers (its default)
    elif alg.advantage == "distill":
        d = run.spec.distill
        task = adv.grpo(scores, batch["group_index"], norm_by_std=alg.norm_by_std) if d.task_weight else None
        if d.estimator == "full":   # the KL is a loss term (policy_objective: actor/distill_kl); the task's advantage
            a = (d.task_weight * task).unsqueeze(1) * mask if task is not None else torch.zeros(mask.shape)
        else:
            a = adv.distill(batch["old_logprobs"], batch["teacher_logprobs"], mask, d.coef, task, d.task_weight)
            valid = mask > 0
            gap = (batch["old_logprobs"] - batch["teacher_logprobs"]) * valid
            total, tokens = dp_sum(torch.stack([gap.sum(), valid.sum()]).double()).tolist()
            metrics["distill/reverse_kl"] = total / max(tokens, 1.0)   # sampled-token (k1) estimate per token
    else:
        raise ValueError(f"unknown advantage estimator {alg.advantage!r}")
    fields.update({"advantages": a.float()} if returns is None else {"advantages": a.float(), "returns": returns.float()})
    valid = mask > 0
    metrics["advantage/mean"] = float((a * valid).sum() / valid.sum().clamp(min=1))
    batch = batch.add(**fields)
    if cor.rejection is not None and bypass:
        batch, m = reject(batch, cor.rejection, cor.rejection_threshold)
        metrics.update(m)
    if alg.pf_ppo.enable:
        batch = pf_ppo(batch, alg.pf_ppo, seed=(run.spec.job.seed, step, torch.distributed.get_rank()
                                                if torch.distributed.is_initialized() else 0))
    return batch, metrics


def reject(batch: Batch, criteria: str, threshold: str | float) -> tuple[Batch, dict]:
    """Rollout rejection sampling (`algorithm.correction.rejection`): rejected tokens leave
    `response_mask` (the loss and its counts); the mask before is kept as `unrejected_mask`."""
    from mrl.algos import rejection

    parsed = rejection.parse(criteria, threshold)
    old, roll, mask = batch["trainer_logprobs"], batch["rollout_logprobs"], batch["response_mask"]
    keep = rejection.mask(old, roll, mask, parsed)
    metrics = {f"correction/rejection/{k}": float(v) for k, v in rejection.mask_metrics(old, roll, mask, parsed).items()}
    tensors = {**batch.tensors, "response_mask": mask * keep.to(mask.dtype), "unrejected_mask": mask}
    return Batch(tensors, batch.meta), metrics


def pf_ppo(batch: Batch, cfg, seed: tuple) -> Batch:
    """PF-PPO: this rank's responses resampled with replacement by a weight of their scores (after
    the advantages, as verl). The resampled rows no longer form prompt groups; `group_index` is
    renumbered in blocks of the original group size so mini-batches split the rows evenly."""
    from mrl.algos import rejection

    gen = torch.Generator().manual_seed(hash(seed) % (2 ** 62))
    out = batch.select(rejection.pf_ppo_indices(batch["rewards"], cfg.method, cfg.weight_pow, generator=gen))
    per_group = max(len(batch) // max(int(batch["group_index"].unique().numel()), 1), 1)
    blocks = torch.arange(len(out)) // per_group
    return Batch({**out.tensors, "group_index": blocks.to(out["group_index"].dtype)}, out.meta)


def policy_objective(run: Run, record=None, teacher=None):
    """The actor's loss; `record` receives the update's log-probs (`UpdateLogprobs`); with
    `distill.estimator = "full"`, `teacher`'s full-vocabulary reverse KL is a loss term."""
    from mrl.engine.objectives import PolicyObjective

    alg = run.spec.algorithm
    full = alg.advantage == "distill" and run.spec.distill.estimator == "full"
    distill = {}
    if full:
        from mrl.train.teacher import teacher_rows

        distill = dict(distill_coef=run.spec.distill.coef, teacher_rows=teacher_rows(teacher))
    cor = alg.correction
    return PolicyObjective(loss=alg.policy_loss, eps_low=alg.clip_low, eps_high=alg.clip_high,
                           clip_c=alg.dual_clip or None, sapo_tau_pos=alg.sapo_tau_pos, sapo_tau_neg=alg.sapo_tau_neg,
                           clip_cov_ratio=alg.clip_cov_ratio, clip_cov_lb=alg.clip_cov_lb, clip_cov_ub=alg.clip_cov_ub,
                           kl_cov_ratio=alg.kl_cov_ratio, kl_cov_coef=alg.kl_cov_coef, dro_beta=alg.dro_beta,
                           is_level=None if cor.level == "off" else cor.level, is_mode=cor.mode,
                           is_threshold=(cor.mask_low, cor.mask_high) if cor.mode == "mask" else cor.threshold,
                           aggregation=alg.loss_aggregation, norm=alg.loss_norm, entropy_coef=alg.entropy_coef,
                           kl_coef=alg.kl_loss.coef if alg.kl_loss.enable else 0.0, kl_estimator=alg.kl_loss.estimator,
                           temperature=run.spec.rollout.temperature, vocab_size=run.hf["vocab_size"],
                           kernels=kernel_backend(run), record=record, **distill)


def kernel_backend(run: Run) -> str:
    """The log-prob kernels the job asked for: Triton on CUDA ("auto") or the torch twins."""
    return "auto" if run.spec.model.use_fused_kernels else "torch"


def value_objective(run: Run):
    from mrl.engine.objectives import ValueObjective

    alg = run.spec.algorithm
    return ValueObjective(clip_eps=alg.value_clip, aggregation=alg.loss_aggregation, norm=alg.loss_norm)


def update(engine, batch: Batch, section, plan, objective, step: int, name: str) -> dict[str, float]:
    """`section.epochs` passes of the plan's mini-batches (`plan`: `mrl.train.plan.Updates`), one
    optimizer update each; means of their metrics."""
    prompts = int(batch["group_index"].max()) + 1 if len(batch) else 0
    records = engine.update(batch, objective, micro_batch_tokens=section.micro_batch_tokens,
                            mini_batches=plan.mini_batches_of(prompts), epochs=plan.epochs,
                            shuffle=getattr(section, "shuffle", False), seed=0, step=step)
    out: dict[str, float] = {}
    for key in records[0]:
        if key == "epoch":   # the pass index of each record: its mean is no measurement (0 with one pass)
            continue
        vals = [float(r[key]) for r in records if key in r]
        out[f"{name}/{key}"] = sum(vals) / len(vals)
    out[f"{name}/grad_norm_max"] = max(float(r["grad_norm"]) for r in records)
    out[f"{name}/updates"] = float(len(records))
    return out



# ---------------------------------------------------------------------------- MoE routing replay

@contextlib.contextmanager
def actor_pass(actor, mode: str, which: str, batch: Batch):
    """Inside: the actor's passes replay what `actor.moe.routing_replay` (`mode`) says for `which`
    ("old": the old-log-prob pass, which records its own routes under r2; "update": the update
    passes). r3 replays the rollout's routes (`rollout_*_routes`, put in the batch by
    `mrl.train.batching`), r2's updates the routes the old-log-prob pass recorded; a dense actor
    (no hooks) or "off" routes by itself. The mechanism is `mrl.engine.routing.RouterHooks`."""
    hooks = actor.routing
    if hooks is None or mode == "off":
        yield
        return
    source: Optional[str] = None
    if mode == "r3":
        if "rollout_prompt_routes" not in batch:
            raise RuntimeError("actor.moe.routing_replay = 'r3', but the rollout returned no routes")
        source = "rollout"
    elif which == "update" and "trainer_prompt_routes" in batch:
        source = "trainer"
    hooks.replay_from, hooks.record = source, (mode == "r2" and which == "old")
    try:
        yield
    finally:
        hooks.replay_from, hooks.record = None, False


def recorded_routes(actor, mode: str, batch: Batch) -> Batch:
    """R2: the batch with the routes the old-log-prob pass recorded."""
    if actor.routing is None or mode != "r2":
        return batch
    return batch.add(**actor.routing.take_recorded(batch))
