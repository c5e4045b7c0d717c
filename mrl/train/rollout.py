"""The rollout stages: weight sync, generation, rewards and DAPO dynamic sampling.

`produce` generates and scores one step's responses for the data-parallel shards this rank
generates for (colocated: its own DP rank; separate: the shards of its engine group) and returns
them as `ShardRollout`s; `to_batch` turns a trainer rank's shard into the `Batch` the learning
stages take. Colocated, both run on every rank in sequence; separate, the rollout ranks produce
and the trainer ranks build the batches (`mrl.train.queue`).

Generation and scoring run on the group leader (the model-parallel group's first rank, or the
engine group's); the responses and scores are broadcast to the group so every rank of it agrees.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from mrl.algos.dapo import keep_groups
from mrl.batch import Batch
from mrl.errors import UserError
from mrl.reward.compose import is_count
from mrl.rollout.types import Response, Sampling, sampling_from_config
from mrl.tracking.samples import sample_rows, wants_samples
from mrl.train.parts import Generation, Learner, Prompts, Run


def _to_group(gen: Generation, obj: Any, work: str = "leader work") -> Any:
    """`obj` from the group leader to every rank of the model-parallel group.

    First every rank waits until all leaders finished `work` (generation, reward scoring), in the
    stage `work` whose timeout covers that work's own bound (`mrl.platform.dist.wait_for_peers`):
    a slow but correct leader never trips the collective timeout of a rank waiting for it."""
    from mrl.platform.dist import stage, wait_for_peers

    wait_for_peers(work)
    if not dist.is_initialized() or gen.mp_group is None or dist.get_world_size(gen.mp_group) == 1:
        return obj
    with stage(f"{work} results"):
        box = [obj if gen.is_leader else None]
        dist.broadcast_object_list(box, group=gen.mp_group, group_src=0)
    return box[0]


def sync_weights(gen: Generation, learner: Learner, version: int) -> int:
    """Colocated: stream the actor's weights into the rollout engine (skipped when it already
    holds them) and record them as policy `version`; returns tensors sent (leader) or 0."""
    gen.version = version
    lost = gen.weights_key is None   # first sync, or the engine dropped its weights (sleep level 2)
    if gen.weights_key == learner.actor.steps:
        if gen.engine is not None:
            gen.engine.wake()
        return 0
    gen.weights_key = learner.actor.steps
    stream = learner.exporter.stream("all")
    if gen.engine is None:
        for _ in stream:   # every rank takes part in the gathers
            pass
        return 0
    gen.engine.wake(tags=["weights"])   # weights first: the KV cache is not needed to load them
    sent = gen.channel.push(stream, version, lost=lost) if gen.channel is not None else gen.engine.update_weights(stream)
    gen.engine.wake(tags=["kv_cache"])
    return sent


def release_engine(gen: Generation, sleep_level: int) -> None:
    """Put the colocated rollout engine to sleep for the training stages (`rollout.sleep_level`,
    0 = never). Level 2 discards the engine's weights: the next sync must send them again even
    when the actor has not changed (validation before training, critic warm-up steps)."""
    if gen.engine is not None and sleep_level > 0:
        gen.engine.sleep(sleep_level)
    if sleep_level >= 2:
        gen.weights_key = None


def generate(run: Run, gen: Generation, prompt_ids: list[list[int]], sampling: Sampling,
             dp_rank: Optional[int] = None) -> list[Response]:
    """Responses to `prompt_ids` (prompt-major, `sampling.n` each), equal on the leader's group.
    Colocated vllm: collective over the world, `dp_rank` naming whose prompts these are."""
    timeout = run.spec.rollout.generate_timeout_s
    if gen.groups is not None and not run.separate:
        from mrl.train.engines import generate_on_groups

        dp = run.ctx.dp_rank if dp_rank is None else dp_rank
        return generate_within(lambda: generate_on_groups(gen.generator, gen.groups, dp, run.dp, prompt_ids, sampling),
                               timeout, len(prompt_ids), sampling.n)
    if gen.groups is not None:   # separate vllm: every rank of the engine group generates together
        return generate_within(lambda: gen.generator.generate(prompt_ids, sampling), timeout, len(prompt_ids),
                               sampling.n)
    out = (generate_within(lambda: gen.generator.generate(prompt_ids, sampling), timeout, len(prompt_ids), sampling.n)
           if gen.is_leader else None)
    return _to_group(gen, out, "rollout generation")


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
    from mrl.reward.compose import RewardSample

    result = None
    model_scores = (reward_model_scores(run, reward_model, items, responses, n) if reward_model is not None
                    else None)
    if gen.is_leader:
        if model_scores is not None:
            gen.rm_scores.scores = model_scores
        tok = run.tokenizer
        samples = [RewardSample(sample_id=f"step {step} prompt {it.index} response {j}", prompt=it.prompt,
                                response=tok.decode(r.token_ids, skip_special_tokens=True), ground_truth=it.answer,
                                data_source=it.data_source, extra=dict(it.extra),
                                token_ids=list(it.token_ids) + list(r.token_ids))
                   for it_i, it in enumerate(items) for j, r in enumerate(responses[it_i * n:(it_i + 1) * n])]
        started = time.perf_counter()
        res = gen.rewarder.score(samples)
        result = dict(scores=res.scores, valid=res.valid,
                      stats={**res.stats, "time/reward_scoring": time.perf_counter() - started})
        try:
            if metric is not None:
                result["filter_values"] = filter_values(res, metric)
            if run.spec.algorithm.gdpo_reward_keys:   # gdpo's components, read by `to_batch`
                result["components"] = [filter_values(res, k) for k in run.spec.algorithm.gdpo_reward_keys]
        except UserError as e:   # raised on every rank of the group, after the broadcast
            result["filter_error"] = str(e)
    result = _to_group(gen, result, "reward scoring")
    if "filter_error" in result:
        raise UserError(result["filter_error"])
    for i, r in enumerate(responses if "components" in result else ()):
        r.info["reward_components"] = [float(c[i]) for c in result["components"]]
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


def _dp_all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    if dist.is_initialized() and ps.get_data_parallel_world_size() > 1:
        t = t.contiguous()
        dist.all_reduce(t, op=op, group=ps.get_data_parallel_group())
    return t




# ---------------------------------------------------------------------------- produce

@dataclass
class ShardRollout:
    """One trainer data-parallel rank's rollouts for one step, as generated and scored: the kept
    prompts (`responses_per_prompt` responses each, prompt-major), their scores, and the round
    statistics. Sent from rollout ranks to trainer ranks when the placement is separate."""

    dp_rank: int
    items: list
    responses: list[Response]
    scores: list[float]
    stats: dict[str, float]
    version: int                    # policy version the responses were generated with


@dataclass
class StepRollout:
    """Every data-parallel shard of one step, with the data position after its prompts."""

    step: int
    version: int
    shards: dict[int, ShardRollout]
    position: dict                  # the prompt samplers' state after this step
    produce_s: float = 0.0          # wall time the rollout side spent generating and scoring it
    finished_at: float = 0.0        # time.time() when it was ready (stage timestamps)
    carry: Optional[dict] = None    # partial rollouts: the groups in hand after it (encoded)


def round_seed(base: int, step: int, rounds: int, dp_rank: int) -> int:
    """The sampling seed of one generation round of one DP shard: generations depend on (step,
    round, shard) only, not on what ran before (resume) or on where they run (placement)."""
    return (((base * 1_000_003 + step) * 1_009 + rounds) * 131 + dp_rank) % 2**31


class _ShardState:
    def __init__(self):
        self.items, self.responses, self.scores = [], [], []
        self.stats: dict[str, float] = {}
        self.generated = self.generated_tokens = self.dropped = 0


def produce(run: Run, gen: Generation, prompts: Prompts, step: int, agree_min: Callable[[int], int],
            reward_model=None) -> StepRollout:
    """Generate and score step `step`'s responses for every shard of `prompts`: per shard
    `prompts_per_step / DP` prompts with `responses_per_prompt` responses each, running more
    generation rounds while dynamic sampling keeps too few. `agree_min(k)` is the minimum of `k`
    over every shard of the step (colocated: a DP all-reduce; separate: over the rollout ranks), so
    all shards run the same rounds and keep the same number of prompts."""
    if run.spec.rollout.partial_rollout_tokens:
        from mrl.train.partial import produce_partial

        return produce_partial(run, gen, prompts, step, agree_min, reward_model)
    spec = run.spec
    dyn = spec.algorithm.dynamic_sampling
    base = spec.rollout.seed
    n = spec.rollout.responses_per_prompt
    per_rank = spec.data.prompts_per_step // run.dp
    started = time.perf_counter()
    state = {d: _ShardState() for d in prompts.shards}
    rounds = 0
    while True:
        for d, st in state.items():
            sampling = sampling_from_config(spec.rollout, seed=round_seed(base, step, rounds, d))
            picked = prompts.samplers[d].next()
            items = [prompts.dataset[i] for i in picked.indices]
            responses = generate(run, gen, [list(it.token_ids) for it in items], sampling, dp_rank=d)
            for x in responses:
                x.policy_version = gen.version
            r = score(run, gen, items, responses, n, step, metric=dyn.metric if dyn.enable else None,
                      reward_model=reward_model)
            st.generated += len(responses)
            st.generated_tokens += sum(len(x.token_ids) for x in responses)
            for k, v in r["stats"].items():   # counts and times add up over rounds; means are the last round's
                st.stats[k] = st.stats.get(k, 0.0) + float(v) if is_count(k) or k.startswith("time/") else float(v)
            groups = torch.arange(len(items)).repeat_interleave(n)
            if dyn.enable:   # groups whose dynamic_sampling.metric is equal for every response carry no signal
                keep = keep_groups(torch.tensor(r["filter_values"], dtype=torch.float64), groups)
            else:
                keep = torch.ones(len(responses), dtype=torch.bool)
            if spec.reward.on_error == "drop":
                valid = torch.tensor(r["valid"], dtype=torch.bool).view(-1, n).all(dim=1).repeat_interleave(n)
                keep &= valid
                st.dropped += int((~valid).sum())
            for i, it in enumerate(items):
                if keep[i * n] and len(st.items) < per_rank:
                    st.items.append(it)
                    st.responses.extend(responses[i * n:(i + 1) * n])
                    st.scores.extend(r["scores"][i * n:(i + 1) * n])
        rounds += 1
        have = agree_min(min(len(st.items) for st in state.values()) if state else per_rank)
        if not dyn.enable or have >= per_rank:
            break
        if dyn.max_generation_batches and rounds >= dyn.max_generation_batches:
            if dyn.on_exhausted == "error":
                raise UserError(f"step {step}: dynamic sampling kept {have} of {per_rank} prompts per rank "
                                f"after {rounds} generation rounds (algorithm.dynamic_sampling.max_generation_batches)")
            break
    # Shards may end a round with different counts: every rank trains on the same number of prompts.
    count = agree_min(min(len(st.items) for st in state.values()) if state else per_rank)
    if count == 0:
        raise UserError(f"step {step}: no prompt kept after {rounds} generation rounds")
    shards = {}
    for d, st in state.items():
        stats = {**st.stats, "rollout/generation_rounds": float(rounds),
                 "rollout/responses_generated": float(st.generated), "tokens/rollout_response": float(st.generated_tokens)}
        if spec.reward.on_error == "drop":
            stats["reward/dropped_responses"] = float(st.dropped)
        shards[d] = ShardRollout(dp_rank=d, items=st.items[:count], responses=st.responses[:count * n],
                                 scores=st.scores[:count * n], stats=stats, version=gen.version)
    return StepRollout(step=step, version=gen.version, shards=shards, position=prompts.position,
                       produce_s=time.perf_counter() - started, finished_at=time.time())


def dp_min(count: int) -> int:
    """Colocated `agree_min`: the minimum over the data-parallel ranks."""
    return int(_dp_all_reduce(torch.tensor([float(count)]), op=dist.ReduceOp.MIN).item())


# ---------------------------------------------------------------------------- to a batch

def to_batch(run: Run, shard: ShardRollout, step: int) -> tuple[Batch, dict[str, float], Optional[dict]]:
    """A trainer rank's `Batch` for `step` from its shard: token ids, group indices, `rewards`
    (after overlong shaping), `rollout_logprobs`, and the step's rollout metrics; plus a sample
    table on the main rank when the step logs one (else None)."""
    spec = run.spec
    alg = spec.algorithm
    n = spec.rollout.responses_per_prompt
    kept_items, kept_resp, kept_scores = shard.items, shard.responses, shard.scores
    batch = Batch.from_sequences([list(it.token_ids) for it in kept_items for _ in range(n)],
                                 [r.token_ids for r in kept_resp],
                                 group_index=[i for i in range(len(kept_items)) for _ in range(n)],
                                 loss_masks=[r.loss_mask for r in kept_resp],
                                 pad_id=run.tokenizer.pad_token_id or 0)
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
    if alg.gdpo_reward_keys:
        batch = batch.add(reward_components=torch.tensor([r.info["reward_components"] for r in kept_resp],
                                                         dtype=torch.float32).view(len(kept_resp), -1))
    metrics = {
        "reward/mean": float(raw_scores.mean()),
        "reward/shaped_mean": float(scores.mean()),
        "response/length_mean": float(batch["response_lengths"].float().mean()),
        "response/truncated_fraction": float(truncated.float().mean()),
        **{k: v for k, v in shard.stats.items() if not math.isnan(v)},
    }
    rows = None
    if run.ctx.is_main and wants_samples(spec.trainer.log_samples_every, step, run.total_steps):
        rows = sample_rows(step, kept_items, kept_resp, raw_scores.tolist(), n, run.tokenizer)
    return batch, metrics, rows
