"""Validation: the current policy on held-out prompts with the validation sampling settings.

The validation prompts come from `data.val_files`, or from the generator with another seed
(`data.val_prompts` of them). Each data-parallel rank takes every DP-th prompt; the logged
`val/reward_mean` is the mean over all of them.
"""
from __future__ import annotations

import torch

from mrl.rollout.types import sampling_from_config
from mrl.train.components import Components
from mrl.train.rollout import _dp_all_reduce, generate, score


def validation_set(c: Components):
    from mrl.data.source import load_prompts

    if "val_dataset" not in c.extras:
        c.extras["val_dataset"] = load_prompts(c.spec.data, c.tokenizer, "val")
    return c.extras["val_dataset"]


def validate(c: Components, step: int) -> dict[str, float]:
    dataset = validation_set(c)
    items = [dataset[i] for i in range(c.ctx.dp_rank, len(dataset), c.ctx.dp)]
    sampling = sampling_from_config(c.spec.rollout, validation=True, seed=c.spec.job.seed)
    # vllm engine groups generate collectively: every rank takes part, with or without prompts
    # every rank takes part, with or without prompts: ranks wait for all group leaders together
    responses = generate(c, [list(it.token_ids) for it in items], sampling)
    scores = score(c, items, responses, sampling.n, step)["scores"]
    lengths = [len(r.token_ids) for r in responses]
    if c.ctx.rank == 0 and c.spec.trainer.log_samples_every > 0:
        from mrl.tracking.samples import sample_rows

        c.extras["samples/validation"] = sample_rows(step, items, responses, scores, sampling.n, c.tokenizer)
    totals = _dp_all_reduce(torch.tensor([sum(scores), float(len(scores)), float(sum(lengths))], dtype=torch.float64))
    count = max(float(totals[1]), 1.0)
    return {"val/reward_mean": float(totals[0]) / count, "val/response_length_mean": float(totals[2]) / count,
            "val/responses": float(totals[1])}
