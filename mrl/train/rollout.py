"""The rollout stages the producer (`mrl.train.produce`) and evaluation run: generation and reward
scoring (the colocated engine's weight sync and sleep are `mrl.train.colocated`'s).

Generation and scoring run on the group leader (the model-parallel group's first rank, or the
engine group's); the responses and scores are broadcast to the group
(`mrl.platform.collectives.from_leader`) so every rank of it agrees.
"""
from __future__ import annotations

import math
import time
from typing import Any, Optional

import torch

from mrl.batch import Batch
from mrl.errors import UserError
from mrl.platform.collectives import from_leader
from mrl.rollout.types import Response, Sampling
from mrl.train.parts import Generation, Run


def generate(run: Run, gen: Generation, prompt_ids: list[list[int]], sampling: Sampling,
             dp_rank: Optional[int] = None, images: Optional[list] = None) -> list[Response]:
    """Responses to `prompt_ids` (prompt-major, `sampling.n` each), equal on the leader's group.
    Colocated vllm: collective over the world, `dp_rank` naming whose prompts these are.
    `images[i]`: prompt i's `ImageInputs` (vision-language models; the hf engine takes them)."""
    timeout = run.spec.rollout.generate_timeout_s
    if images is not None and any(x is not None for x in images):
        if gen.groups is not None:
            raise UserError("rollout: prompts with images run on rollout.engine = 'hf' only (vLLM's multi_modal_data "
                            "is not wired yet)")
        out = (generate_within(lambda: gen.generator.generate(prompt_ids, sampling, images=images), timeout,
                               len(prompt_ids), sampling.n) if gen.is_leader else None)
        return from_leader(out, gen.mp_group, gen.is_leader, "rollout generation")
    if gen.groups is not None and not run.separate:
        from mrl.train.engine_groups import generate_on_groups

        dp = run.ctx.dp_rank if dp_rank is None else dp_rank
        return generate_within(lambda: generate_on_groups(gen.generator, gen.groups, dp, run.dp, prompt_ids, sampling),
                               timeout, len(prompt_ids), sampling.n)
    if gen.groups is not None:   # separate vllm: every rank of the engine group generates together
        return generate_within(lambda: gen.generator.generate(prompt_ids, sampling), timeout, len(prompt_ids),
                               sampling.n)
    out = (generate_within(lambda: gen.generator.generate(prompt_ids, sampling), timeout, len(prompt_ids), sampling.n)
           if gen.is_leader else None)
    return from_leader(out, gen.mp_group, gen.is_leader, "rollout generation")


def generate_within(call, timeout_s: float, prompts: int, n: int):
    """`call()` (a generate call), or a `UserError` once it has run `timeout_s` seconds
    (`rollout.generate_timeout_s`). It runs in a daemon thread carrying this thread's grad mode and
    CUDA device, so a generation that never returns cannot hold the process past the error."""
    import threading

    box: dict[str, Any] = {}
    grad = torch.is_grad_enabled()
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def run():
        try:
            if device is not None:
                torch.cuda.set_device(device)
            with torch.set_grad_enabled(grad):
                box["out"] = call()
        except BaseException as e:   # re-raised in the caller's thread
            box["error"] = e

    worker = threading.Thread(target=run, name="mrl-generate", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise UserError(f"rollout: generating {prompts} prompts x {n} responses ran longer than "
                        f"rollout.generate_timeout_s = {timeout_s:g} s; raise it or lower rollout.max_response_tokens")
    if "error" in box:
        raise box["error"]
    return box["out"]


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
