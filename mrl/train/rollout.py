"""Rollout stage: weight sync, generation, rewards and DAPO dynamic sampling -> a `Batch`.

Generation and scoring run on the model-parallel group's leader; the responses and scores are
broadcast to the group so every TP/PP rank builds the identical batch.
"""
from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist

from mrl.algos.dapo import keep_groups
from mrl.batch import Batch
from mrl.errors import UserError
from mrl.reward.compose import is_count
from mrl.rollout.types import Response, Sampling, sampling_from_config
from mrl.tracking.samples import sample_rows, wants_samples
from mrl.train.components import Components


def _to_group(c: Components, obj: Any, work: str = "leader work") -> Any:
    """`obj` from the group leader to every rank of the model-parallel group.

    First every rank waits until all leaders finished `work` (generation, reward scoring), in the
    stage `work` whose timeout covers that work's own bound (`mrl.platform.dist.wait_for_peers`):
    a slow but correct leader never trips the collective timeout of a rank waiting for it."""
    from mrl.platform.dist import stage, wait_for_peers

    wait_for_peers(work)
    if not dist.is_initialized() or dist.get_world_size(c.mp_group) == 1:
        return obj
    with stage(f"{work} results"):
        box = [obj if c.is_leader else None]
        dist.broadcast_object_list(box, src=c.mp_leader, group=c.mp_group)
    return box[0]


def sync_weights(c: Components) -> int:
    """Stream the actor's weights into the rollout engine (skipped when it already holds this
    version of them); returns tensors sent (leader) or 0."""
    version = (c.actor.steps, id(c.actor))
    if c.extras.get("synced_version") == version:
        if c.rollout is not None:
            c.rollout.wake()
        return 0
    c.extras["synced_version"] = version
    stream = c.exporter.stream("all")
    if c.rollout is None:
        for _ in stream:   # every rank takes part in the gathers
            pass
        return 0
    c.rollout.wake(tags=["weights"])   # weights first: the KV cache is not needed to load them
    sent = c.rollout.update_weights(stream)
    c.rollout.wake(tags=["kv_cache"])
    return sent


def release_engine(c: Components) -> None:
    """Put the rollout engine to sleep for the training stages (`rollout.sleep_level`, 0 = never).
    Level 2 discards the engine's weights: the next sync must send them again even when the
    actor has not changed (validation before training, critic warm-up steps)."""
    if c.rollout is not None and c.spec.rollout.sleep_level > 0:
        c.rollout.sleep(c.spec.rollout.sleep_level)
    if c.spec.rollout.sleep_level >= 2:
        c.extras.pop("synced_version", None)


def generate(c: Components, prompt_ids: list[list[int]], sampling: Sampling) -> list[Response]:
    """This DP rank's responses, equal on its model-parallel group. vllm: collective over the world."""
    if c.engine_groups is not None:
        from mrl.train.engines import generate_on_groups

        return generate_within(lambda: generate_on_groups(c.generator, c.engine_groups, c.ctx.dp_rank, c.ctx.dp,
                                                          prompt_ids, sampling),
                               c.spec.rollout.generate_timeout_s, len(prompt_ids), sampling.n)
    out = (generate_within(lambda: c.generator.generate(prompt_ids, sampling), c.spec.rollout.generate_timeout_s,
                           len(prompt_ids), sampling.n) if c.is_leader else None)
    return _to_group(c, out, "rollout generation")


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


def score(c: Components, items: list, responses: list[Response], n: int, step: int, metric: str | None = None) -> dict:
    """Rewards of `responses` (prompt-major, `n` per item) as plain lists, equal on the group;
    with `metric`, also the dynamic-sampling values (`filter_values`) of each response."""
    from mrl.reward.compose import RewardSample

    result = None
    model_scores = reward_model_scores(c, items, responses, n) if c.reward_model is not None else None
    if c.is_leader:
        if model_scores is not None:
            c.rm_scores.scores = model_scores
        tok = c.tokenizer
        samples = [RewardSample(sample_id=f"step {step} prompt {it.index} response {j}", prompt=it.prompt,
                                response=tok.decode(r.token_ids, skip_special_tokens=True), ground_truth=it.answer,
                                data_source=it.data_source, extra=dict(it.extra),
                                token_ids=list(it.token_ids) + list(r.token_ids))
                   for it_i, it in enumerate(items) for j, r in enumerate(responses[it_i * n:(it_i + 1) * n])]
        started = time.perf_counter()
        res = c.rewarder.score(samples)
        result = dict(scores=res.scores, valid=res.valid,
                      stats={**res.stats, "time/reward_scoring": time.perf_counter() - started})
        if metric is not None:
            try:
                result["filter_values"] = filter_values(res, metric)
            except UserError as e:   # raised on every rank of the group, after the broadcast
                result["filter_error"] = str(e)
    result = _to_group(c, result, "reward scoring")
    if "filter_error" in result:
        raise UserError(result["filter_error"])
    return result


def reward_model_scores(c: Components, items: list, responses: list[Response], n: int) -> list[float]:
    """The reward model's value at each sequence's last token (prompt + response), on every rank.

    One padding token is appended to each response: the value read "before" it is the model's
    output at the last real token.
    """
    from mrl.engine.objectives import values_output

    pad = c.tokenizer.pad_token_id or 0
    prompts = [list(it.token_ids) for it in items for _ in range(n)]
    batch = Batch.from_sequences(prompts, [list(r.token_ids) + [pad] for r in responses], pad_id=pad)
    budget = c.spec.reward.micro_batch_tokens   # resolved: actor.micro_batch_tokens unless set
    values = c.reward_model.forward_only(batch, values_output(), micro_batch_tokens=budget)["values"].cpu()
    return [float(values[i, len(r.token_ids)]) for i, r in enumerate(responses)]


def _dp_all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    if dist.is_initialized() and ps.get_data_parallel_world_size() > 1:
        t = t.contiguous()
        dist.all_reduce(t, op=op, group=ps.get_data_parallel_group())
    return t


def _round(c: Components, step: int, sampling: Sampling) -> dict:
    """One generation round: this rank's next prompts, n responses each, scored."""
    picked = c.sampler.next()
    items = [c.dataset[i] for i in picked.indices]
    responses = generate(c, [list(it.token_ids) for it in items], sampling)
    dyn = c.spec.algorithm.dynamic_sampling
    scored = score(c, items, responses, sampling.n, step, metric=dyn.metric if dyn.enable else None)
    return dict(items=items, responses=responses, **scored)


def collect(c: Components, step: int) -> tuple[Batch, dict]:
    """This rank's batch for `step`: prompts_per_step / DP prompts, `responses_per_prompt` each,
    with `rewards` (after overlong shaping) and `rollout_logprobs`."""
    spec = c.spec
    alg = spec.algorithm
    base = spec.rollout.seed
    n = spec.rollout.responses_per_prompt
    per_rank = spec.data.prompts_per_step // c.ctx.dp
    dyn = alg.dynamic_sampling
    rounds, kept_items, kept_resp, kept_scores = 0, [], [], []
    stats: dict[str, float] = {}
    generated = 0
    generated_tokens = 0
    dropped = 0   # responses left out for reward errors (reward.on_error = "drop"): whole groups
    while True:
        # A seed per (step, round, DP rank): generations do not depend on what ran before (resume).
        seed = (((base * 1_000_003 + step) * 1_009 + rounds) * 131 + c.ctx.dp_rank) % 2**31
        sampling = sampling_from_config(spec.rollout, seed=seed)
        r = _round(c, step, sampling)
        rounds += 1
        generated += len(r["responses"])
        generated_tokens += sum(len(x.token_ids) for x in r["responses"])
        for k, v in r["stats"].items():   # counts and times add up over rounds; means are the last round's
            stats[k] = stats.get(k, 0.0) + float(v) if is_count(k) or k.startswith("time/") else float(v)
        scores = torch.tensor(r["scores"], dtype=torch.float32)
        groups = torch.arange(len(r["items"])).repeat_interleave(n)
        if dyn.enable:   # groups whose dynamic_sampling.metric is equal for every response carry no signal
            keep = keep_groups(torch.tensor(r["filter_values"], dtype=torch.float64), groups)
        else:
            keep = torch.ones(len(scores), dtype=torch.bool)
        if spec.reward.on_error == "drop":
            valid = torch.tensor(r["valid"], dtype=torch.bool).view(-1, n).all(dim=1).repeat_interleave(n)
            keep &= valid
            dropped += int((~valid).sum())
        for i, it in enumerate(r["items"]):
            if keep[i * n] and len(kept_items) < per_rank:
                kept_items.append(it)
                kept_resp.extend(r["responses"][i * n:(i + 1) * n])
                kept_scores.extend(r["scores"][i * n:(i + 1) * n])
        have = _dp_all_reduce(torch.tensor([float(len(kept_items))]), op=dist.ReduceOp.MIN)
        if not dyn.enable or int(have.item()) >= per_rank:
            break
        if dyn.max_generation_batches and rounds >= dyn.max_generation_batches:
            if dyn.on_exhausted == "error":
                raise UserError(f"step {step}: dynamic sampling kept {int(have.item())} of {per_rank} prompts per rank "
                                f"after {rounds} generation rounds (algorithm.dynamic_sampling.max_generation_batches)")
            break
    if spec.reward.on_error == "drop":
        stats["reward/dropped_responses"] = float(dropped)
    if not kept_items:
        raise UserError(f"step {step}: no prompt kept after {rounds} generation rounds")
    # Ranks may end a round with different counts: every rank trains on the same number of prompts.
    count = int(_dp_all_reduce(torch.tensor([float(len(kept_items))]), op=dist.ReduceOp.MIN).item())
    kept_items, kept_resp, kept_scores = kept_items[:count], kept_resp[:count * n], kept_scores[:count * n]

    batch = Batch.from_sequences([list(it.token_ids) for it in kept_items for _ in range(n)],
                                 [r.token_ids for r in kept_resp],
                                 group_index=[i for i in range(len(kept_items)) for _ in range(n)],
                                 loss_masks=[r.loss_mask for r in kept_resp],
                                 pad_id=c.tokenizer.pad_token_id or 0)
    width = batch.response_width
    rollout_lp = torch.zeros(len(kept_resp), width)
    for i, r in enumerate(kept_resp):
        rollout_lp[i, :len(r.logprobs)] = torch.tensor(r.logprobs, dtype=torch.float32)
    truncated = torch.tensor([r.finish_reason == "length" for r in kept_resp])
    scores = torch.tensor(kept_scores, dtype=torch.float32)
    raw_scores = scores.clone()
    if alg.overlong.enable:
        from mrl.algos.dapo import overlong_penalty

        scores = scores + overlong_penalty(batch["response_lengths"], spec.rollout.max_response_tokens,
                                           alg.overlong.buffer_tokens, alg.overlong.penalty_factor)
    mask = batch["response_mask"]
    if alg.overlong.enable and alg.overlong.mask_truncated:
        mask = mask * (~truncated).long().unsqueeze(1)
    batch = Batch({**batch.tensors, "response_mask": mask}, {"prompt_item": [it for it in kept_items for _ in range(n)]})
    batch = batch.add(rewards=scores, raw_scores=raw_scores, rollout_logprobs=rollout_lp, truncated=truncated.long())
    metrics = {
        "reward/mean": float(raw_scores.mean()),
        "reward/shaped_mean": float(scores.mean()),
        "response/length_mean": float(batch["response_lengths"].float().mean()),
        "response/truncated_fraction": float(truncated.float().mean()),
        "rollout/generation_rounds": float(rounds),
        "rollout/responses_generated": float(generated),
        "tokens/rollout_response": float(generated_tokens),
        **{k: v for k, v in stats.items() if not math.isnan(v)},
    }
    if c.ctx.rank == 0 and wants_samples(spec.trainer.log_samples_every, step, c.total_steps):
        c.extras["samples/train"] = sample_rows(step, kept_items, kept_resp, raw_scores.tolist(), n, c.tokenizer)
    return batch, metrics
