"""Validation: the current policy on held-out prompts with the validation sampling settings.

The validation prompts come from `data.val_files`, or from the generator with another seed
(`data.val_prompts` of them). Each data-parallel rank takes every DP-th prompt; the logged
`val/reward_mean` is the mean over all of them.
"""
from __future__ import annotations

import torch

from typing import Optional

from mrl.rollout.types import sampling_from_config
from mrl.train.parts import Generation, Prompts, Run, SampleLog
from mrl.train.rollout import _dp_all_reduce, generate, score


def validation_set(run: Run, prompts: Prompts):
    """The validation prompts, loaded on first use and kept."""
    from mrl.data.source import load_prompts

    if prompts.val_dataset is None:
        prompts.val_dataset = load_prompts(run.spec.data, run.tokenizer, "val")
    return prompts.val_dataset


def validate(run: Run, gen: Generation, prompts: Prompts, step: int, samples: Optional[SampleLog] = None,
             reward_model=None) -> dict[str, float]:
    """`val/*` metrics of the policy the engine holds, on this rank's share of the validation set."""
    dataset = validation_set(run, prompts)
    ctx = run.ctx
    items = [dataset[i] for i in range(ctx.dp_rank, len(dataset), ctx.dp)]
    sampling = sampling_from_config(run.spec.rollout, validation=True, seed=run.spec.job.seed)
    # vllm engine groups generate collectively: every rank takes part, with or without prompts
    responses = generate(run, gen, [list(it.token_ids) for it in items], sampling)
    scores = score(run, gen, items, responses, sampling.n, step, reward_model=reward_model)["scores"]
    lengths = [len(r.token_ids) for r in responses]
    if ctx.is_main and run.spec.trainer.log_samples_every > 0 and samples is not None:
        from mrl.tracking.samples import sample_rows

        samples.put("validation", sample_rows(step, items, responses, scores, sampling.n, run.tokenizer))
    totals = _dp_all_reduce(torch.tensor([sum(scores), float(len(scores)), float(sum(lengths))], dtype=torch.float64))
    count = max(float(totals[1]), 1.0)
    return {"val/reward_mean": float(totals[0]) / count, "val/response_length_mean": float(totals[2]) / count,
            "val/responses": float(totals[1])}
