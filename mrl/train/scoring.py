"""The reward stage the producer (`mrl.train.produce`) and evaluation run: scoring responses
with the job's rewards (`mrl.reward`), the reward model's values, and the dynamic-sampling values
(`filter_values`). Generation is `mrl.train.rollout`'s.

Scoring runs on the group leader (the model-parallel group's first rank, or the engine group's);
the scores are broadcast to the group (`mrl.platform.collectives.from_leader`) so every rank of
it agrees. A step's reward statistics are the response-weighted means over its scoring calls
(`mrl.train.metrics.reward_stats`).
"""
from __future__ import annotations

import math
import time

from mrl.batch import Batch
from mrl.errors import UserError
from mrl.platform.collectives import from_leader
from mrl.rollout.types import Response
from mrl.train.parts import Generation, Run


def filter_values(result, metric: str) -> list[float]:
    """Per-response values of `algorithm.dynamic_sampling.metric`: "score" (the reward), a reward
    source's name (its own score), or a number the rewards return in their dicts, as "<source>/<key>"
    or a bare "<key>" one source returns. A failed reward counts as 0, like its score. Raises
    `UserError` naming what the rewards did return when none matches."""
    if metric == "score":
        values = result.scores
    elif metric in result.source_scores:
        values = result.source_scores[metric]
    elif metric in result.metrics:
        values = result.metrics[metric]
    else:
        found = [k for k in result.metrics if k.rpartition("/")[2] == metric]
        if len(found) != 1:
            returned = ", ".join(["score", *result.source_scores, *result.metrics])
            why = f"several sources return it ({', '.join(found)}): name one" if found else f"the rewards return: {returned}"
            raise UserError(f"algorithm.dynamic_sampling.metric = {metric!r}: no such reward output; {why}")
        values = result.metrics[found[0]]
    return [0.0 if math.isnan(v) else float(v) for v in values]


def score(run: Run, gen: Generation, items: list, responses: list[Response], n: int, step: int,
          metric: str | None = None, reward_model=None) -> dict:
    """Rewards of `responses` (prompt-major, `n` per item) as plain lists, equal on the group;
    with `metric`, also the dynamic-sampling values (`filter_values`) of each response.
    `reward_model`: the value-head engine, run on every rank of the group first (colocated)."""
    result = None
    model_scores = (reward_model_scores(run, reward_model, items, responses, n) if reward_model is not None
                    else None)
    if gen.is_leader:
        if model_scores is not None:
            gen.rm_scores.scores = model_scores
        result = leader_score(run, gen, items, responses, n, step, metric)
    result = from_leader(result, gen.mp_group, gen.is_leader, "reward scoring")
    if "filter_error" in result:
        raise UserError(result["filter_error"])
    for i, r in enumerate(responses if "components" in result else ()):
        r.info["reward_components"] = [float(c[i]) for c in result["components"]]
    return result


def leader_score(run: Run, gen: Generation, items: list, responses: list[Response], n: int, step: int,
                 metric: str | None = None) -> dict:
    """`score`'s work on the group's leader alone (no broadcast, no reward model): the reward
    function's scores, validity, stats and, with `metric`, the dynamic-sampling values; a metric
    the rewards lack is returned as `filter_error` (raised on every rank after the broadcast)."""
    from mrl.reward.compose import RewardSample

    tok = run.tokenizer
    samples = [RewardSample(sample_id=f"step {step} prompt {it.index} response {j}", prompt=it.prompt,
                            response=tok.decode(r.token_ids, skip_special_tokens=True), ground_truth=it.answer,
                            data_source=it.data_source, extra=dict(it.extra),
                            token_ids=list(it.token_ids) + list(r.token_ids))
               for it_i, it in enumerate(items) for j, r in enumerate(responses[it_i * n:(it_i + 1) * n])]
    started = time.perf_counter()
    res = gen.rewarder.score(samples)
    result = dict(scores=res.scores, valid=res.valid, stats={**res.stats, "time/reward_scoring": time.perf_counter() - started})
    try:
        if metric is not None:
            result["filter_values"] = filter_values(res, metric)
        if run.spec.algorithm.gdpo_reward_keys:   # gdpo's components, read by `to_batch`
            result["components"] = [filter_values(res, k) for k in run.spec.algorithm.gdpo_reward_keys]
    except UserError as e:   # raised on every rank of the group, after the broadcast
        result["filter_error"] = str(e)
    return result


def reward_model_scores(run: Run, reward_model, items: list, responses: list[Response], n: int) -> list[float]:
    """The reward model's value at each sequence's last token (prompt + response), on every rank.

    One padding token is appended to each response: the value read "before" it is the model's
    output at the last real token.
    """
    from mrl.engine.objectives import values_output

    pad = run.tokenizer.pad_token_id or 0
    prompts = [list(it.token_ids) for it in items for _ in range(n)]
    batch = Batch.from_sequences(prompts, [list(r.token_ids) + [pad] for r in responses], pad_id=pad)
    budget = run.spec.reward.micro_batch_tokens   # resolved: actor.micro_batch_tokens unless set
    values = reward_model.forward_only(batch, values_output(), micro_batch_tokens=budget)["values"].cpu()
    return [float(values[i, len(r.token_ids)]) for i, r in enumerate(responses)]
