"""Every derived default of a job spec, filled once, before any check: `resolve` turns the `None` =
"derive it" fields into concrete values (the run name, DP-dependent batch sizes, the tokenizer,
seeds, tracking and checkpoint locations, ...), so `mrl show` prints what will run and re-loads to
the same spec; `resolve_shared` is the part SFT jobs share (`sft_job.resolve`). The checks that
follow are `validate.py`'s.
"""
from __future__ import annotations

import dataclasses
import os

from mrl.algos.rejection_spec import expand_preset
from mrl.config.job import JobSpec

GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline", "opo", "grpo_passk", "gpg", "gdpo", "optimal_token_baseline",
                     "tir_optimal_token_baseline")
GROUP_RESPONSES = 8   # rollout.responses_per_prompt when unset and the estimator compares a group's responses
SEQ_MEAN_LOSSES = ("sapo", "geo_mean")   # mrl.algos.losses.FORCED_AGG_MODE (importing it would import torch)


def _replace(obj, **changes):
    return dataclasses.replace(obj, **changes) if changes else obj


def resolve_shared(spec, default_name: str = "job") -> dict:
    """Derived (`None`) fields of the sections every kind of job shares (`[job]`, `[parallel]`,
    `[data]`, `[model]`, `[tracking]`, `[checkpoint]`), as `{section: resolved section}`: RL jobs
    (`resolve`) and SFT jobs (`mrl.sft.config.resolve`) fill them by these rules only."""
    job = _replace(spec.job, **({"name": default_name} if not spec.job.name else {}))
    if not os.path.isabs(job.output_dir):   # the default, "runs": under the working directory
        job = _replace(job, output_dir=os.path.abspath(job.output_dir))
    par = _replace(spec.parallel, **({"expert_tensor": spec.parallel.tensor} if spec.parallel.expert_tensor is None else {}))
    data = spec.data if spec.data.seed is not None else _replace(spec.data, seed=job.seed)
    model = spec.model if spec.model.tokenizer is not None else _replace(spec.model, tokenizer=spec.model.path)
    tracking = spec.tracking if spec.tracking.run_name else _replace(spec.tracking, run_name=job.name)
    if tracking.tracking_uri is None:
        # one store per output directory: `mlflow ui` on it shows (and compares) every run of the project
        store = os.path.join(os.path.abspath(job.output_dir), "mlflow.db")
        tracking = _replace(tracking, tracking_uri=f"sqlite:///{store}")
    checkpoint = spec.checkpoint
    if checkpoint.dir is None:
        checkpoint = _replace(checkpoint, dir=os.path.join(job.output_dir, job.name, "checkpoints"))
    return dict(job=job, parallel=par, data=data, model=model, tracking=tracking, checkpoint=checkpoint)


def resolve(spec: JobSpec, default_name: str = "job") -> JobSpec:
    """Replace derived (`None`) fields by their values. Idempotent."""
    shared = resolve_shared(spec, default_name)
    job = shared["job"]
    alg = expand_preset(spec.algorithm)
    if alg.loss_aggregation is None:
        forced = "seq-mean-token-mean" if alg.policy_loss in SEQ_MEAN_LOSSES else "token-mean"
        alg = _replace(alg, loss_aggregation=forced)
    if alg.loss_aggregation == "seq-mean-token-sum-norm" and alg.loss_norm is None:
        # a constant divisor: the padded width of a batch changes from step to step and rank to rank
        alg = _replace(alg, loss_norm=float(spec.rollout.max_response_tokens))
    if alg.dynamic_sampling.generation_batch_prompts is None:
        alg = _replace(alg, dynamic_sampling=_replace(alg.dynamic_sampling,
                                                      generation_batch_prompts=spec.data.prompts_per_step))
    kl_on = alg.kl_loss.enable or alg.kl_reward.enable or (alg.objective == "dpo" and alg.dpo.loss != "simpo")
    actor = spec.actor
    if actor.mini_batch_prompts is None:
        actor = _replace(actor, mini_batch_prompts=spec.data.prompts_per_step)
    if actor.logprob_micro_batch_tokens is None:
        actor = _replace(actor, logprob_micro_batch_tokens=actor.micro_batch_tokens)
    critic = spec.critic
    if critic.enable is None:
        critic = _replace(critic, enable=alg.advantage == "gae")
    if critic.mini_batch_prompts is None:
        critic = _replace(critic, mini_batch_prompts=actor.mini_batch_prompts)
    if critic.enable and critic.model_path is None:
        critic = _replace(critic, model_path=spec.model.path)
    ref = spec.ref if spec.ref.enable is not None else _replace(spec.ref, enable=kl_on)
    if ref.enable and ref.model_path is None:
        ref = _replace(ref, model_path=spec.model.path)
    distill = spec.distill
    if distill.model_path is not None and distill.micro_batch_tokens is None:
        distill = _replace(distill, micro_batch_tokens=actor.micro_batch_tokens)
    if distill.model_path is not None and distill.dtype is None:
        distill = _replace(distill, dtype=spec.model.dtype)
    if ref.enable and ref.micro_batch_tokens is None:
        ref = _replace(ref, micro_batch_tokens=actor.micro_batch_tokens)
    reward = spec.reward
    has_model = reward.model_path is not None or any("model_path" in s for s in reward.sources)
    if has_model and reward.micro_batch_tokens is None:
        reward = _replace(reward, micro_batch_tokens=actor.micro_batch_tokens)
    data = shared["data"]
    rollout = spec.rollout
    if rollout.responses_per_prompt is None:   # a group estimator needs a group: a minimal GRPO job is valid
        rollout = _replace(rollout, responses_per_prompt=GROUP_RESPONSES if alg.advantage in GROUP_ESTIMATORS
                                                         or alg.objective == "dpo" else 1)
    if rollout.dtype is None:
        rollout = _replace(rollout, dtype=spec.model.dtype)
    if rollout.seed is None:
        rollout = _replace(rollout, seed=job.seed)
    if rollout.max_model_len is None:
        rollout = _replace(rollout, max_model_len=data.max_prompt_tokens + rollout.max_response_tokens)
    if rollout.weight_sync.dtype is None:
        rollout = _replace(rollout, weight_sync=_replace(rollout.weight_sync, dtype=rollout.dtype))
    return dataclasses.replace(spec, **shared, algorithm=alg, actor=actor, critic=critic, ref=ref, reward=reward,
                               rollout=rollout, distill=distill)
