"""Evaluation (`trainer.val_*`): the current policy on held-out prompts with the validation
sampling settings. (Spec checks are `mrl.config.validate`; this module only evaluates.)

The validation prompts come from `data.val_files`, or from the generator with another seed
(`data.val_prompts` of them). Each data-parallel rank takes every DP-th prompt; the logged
`val/reward_mean` is the mean over all of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from mrl.platform.collectives import dp_all_reduce, world_reduce
from mrl.rollout.types import sampling_from_config
from mrl.train.parts import Generation, Prompts, Run, SampleLog
from mrl.train.rollout import generate
from mrl.train.scoring import score


@dataclass
class ValidationResult:
    """One validation of policy `version`: `val/*` metrics and sample rows."""

    version: int
    metrics: dict[str, float]
    rows: Optional[list]


def validation_set(run: Run, prompts: Prompts):
    """The validation prompts, loaded on first use and kept."""
    from mrl.data.source import load_prompts
    from mrl.rollout.multi_turn import prompt_tools

    if prompts.val_dataset is None:   # the tools as listed at build (`Prompts.tool_schemas`): no second listing
        prompts.val_dataset = load_prompts(run.spec.data, run.tokenizer, "val", images=run.images,
                                           tools=prompt_tools(run.spec, prompts.tool_schemas))
    return prompts.val_dataset


def validation_steps(trainer, total_steps: int, start: int = 0) -> list[int]:
    """The policy versions (steps) a run validates after `start`: 0 with `val_before_train` on a
    fresh start, every `val_every_steps`-th and the last."""
    every = trainer.val_every_steps
    steps = [0] if trainer.val_before_train and start == 0 else []
    if every:
        steps += [s for s in range(start + 1, total_steps + 1) if s % every == 0 or s == total_steps]
    return steps


def evaluate(run: Run, gen: Generation, prompts: Prompts, step: int, samples: Optional[SampleLog] = None,
             reward_model=None) -> dict[str, float]:
    """`val/*` metrics of the policy the engine holds, on this rank's share of the validation set.

    Colocated: each data-parallel rank takes every DP-th prompt and the sums are reduced over DP.
    Separate (on the rollout ranks): each engine group takes every G-th prompt and the sums of the
    group leaders are reduced over the rollout ranks."""
    dataset = validation_set(run, prompts)
    ctx, plan = run.ctx, run.plan
    on_rollout_ranks = ctx.role == "rollout"
    if on_rollout_ranks:
        share, shares = plan.engine_group_of(ctx.rank), plan.engine_groups
    else:
        share, shares = ctx.dp_rank, plan.dp
    items = [dataset[i] for i in range(share, len(dataset), shares)]
    sampling = sampling_from_config(run.spec.rollout, validation=True, seed=run.spec.job.seed)
    # vllm engine groups generate collectively: every rank takes part, with or without prompts
    responses = generate(run, gen, [list(it.token_ids) for it in items], sampling,
                         images=[getattr(it, "images", None) for it in items])
    scores = score(run, gen, items, responses, sampling.n, step, reward_model=reward_model)["scores"]
    lengths = [len(r.token_ids) for r in responses]
    first = ctx.rank == 0 if on_rollout_ranks else ctx.is_main   # whose share the table shows
    if first and run.spec.trainer.log_samples_every > 0 and samples is not None:
        from mrl.tracking.samples import sample_rows

        samples.put("validation", sample_rows(step, items, responses, scores, sampling.n, run.tokenizer))
    sums = torch.tensor([sum(scores), float(len(scores)), float(sum(lengths))], dtype=torch.float64)
    if on_rollout_ranks:   # the leaders' sums (the other ranks of an engine group hold copies)
        totals = world_reduce(sums * float(gen.is_leader), "validation sums")
    else:
        totals = dp_all_reduce(sums, "validation sums")
    count = max(float(totals[1]), 1.0)
    return {"val/reward_mean": float(totals[0]) / count, "val/response_length_mean": float(totals[2]) / count,
            "val/responses": float(totals[1])}
