"""The producer: one step's rollouts for the data-parallel shards this rank generates for.

`produce` runs generation rounds until every shard holds the plan's `prompts_per_rank` kept
groups (`mrl.train.plan`). One loop serves both ways of generating:

- whole (`rollout.partial_rollout_tokens = 0`): each round draws a generation batch of prompts
  per shard and generates all their responses to the end in one call;
- partial (C > 0): each round advances every unfinished response by at most C tokens
  (`mrl.train.rollout.advance`); groups still generating when the batch is complete, and kept
  groups beyond it, are carried over to the next step, where they continue with newer weights.
  New prompts are drawn only when the groups in hand cannot complete the batch, and a group whose
  oldest response would lag the trained policy by more than `rollout.max_staleness` is dropped and
  counted (`rollout/stale_dropped_*`). `rollout/partial_tokens_carried` counts the tokens earlier
  steps generated for this step's responses.

Finished groups are scored (`mrl.train.scoring.score`) and kept or dropped by `keep_groups_of`
(dynamic sampling and `reward.on_error = "drop"`, the one keep/drop rule); the step's reward
statistics are made once from every scoring call (`mrl.train.metrics.reward_stats`:
response-weighted means). With ReMax the greedy baseline of each kept prompt is generated and
scored here too (`ShardRollout.greedy_scores`), so the learning half never generates.

`agree_min(k)` is the minimum of `k` over every shard of the step (colocated: the data-parallel
ranks; separate: the rollout ranks), so all shards run the same rounds and keep the same count;
None when this rank produces every shard (one router on the driver, `mrl.train.driver`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from mrl.algos.dapo import keep_groups
from mrl.errors import UserError
from mrl.rollout.types import Response, sampling_from_config
from mrl.train.carry import encode_carry
from mrl.train.groups import GroupInProgress, ShardCarry
from mrl.train.metrics import reward_stats
from mrl.train.parts import Generation, Prompts, Run
from mrl.train.rollout import advance, generate
from mrl.train.scoring import leader_score, score
from mrl.train.server_round import server_round, server_rounds


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
    version: int                    # policy version the responses were generated with (the oldest)
    greedy_scores: Optional[list[float]] = None   # ReMax: the greedy response's score, per prompt


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


def keep_groups_of(scored: dict, n: int, dynamic_sampling: bool, drop_invalid: bool) -> tuple[list[bool], int]:
    """Which of the scored groups (`n` responses each, prompt-major) a step keeps, and how many
    responses were dropped for a failed reward. Dynamic sampling drops groups whose
    `dynamic_sampling.metric` is equal for every response (they carry no signal); with
    `reward.on_error = "drop"` a group with a failed reward is dropped whole."""
    responses = len(scored["scores"])
    groups = torch.arange(responses // n).repeat_interleave(n)
    keep = (keep_groups(torch.tensor(scored["filter_values"], dtype=torch.float64), groups) if dynamic_sampling
            else torch.ones(responses, dtype=torch.bool))
    dropped = 0
    if drop_invalid:
        valid = torch.tensor(scored["valid"], dtype=torch.bool).view(-1, n).all(dim=1).repeat_interleave(n)
        keep &= valid
        dropped = int((~valid).sum())
    return [bool(keep[i * n]) for i in range(responses // n)], dropped


def drop_stale(c: ShardCarry, oldest: int, n: int, st: dict) -> None:
    """Drop the groups whose oldest response began before policy version `oldest` (it would lag
    the trained policy by more than `rollout.max_staleness`), counting them in `st`."""
    for pool in (c.active, c.ready):
        for g in [g for g in pool if min(g.versions) < oldest]:
            pool.remove(g)
            st["stale_dropped_responses"] += n
            st["stale_dropped_tokens"] += sum(len(t) for t in g.tokens)


def refresh_unstarted(active: list[GroupInProgress], version: int) -> None:
    """Server mode: trajectories in hand that have not generated a token yet (drawn beyond the
    submitted target, or aborted before their first token) are as new as the policy that will
    start them, `version` (so `drop_stale` never drops a prompt that has not been tried)."""
    for g in active:
        for j, tokens in enumerate(g.tokens):
            if not tokens and g.finish[j] is None:
                g.versions[j] = version


def target_groups(per_rank: int, ready: int, over_sample_rate: float) -> int:
    """Server mode: the groups a shard keeps in hand (ready + generating) for a step of `per_rank`
    groups: ceil((1 + rate) x what it still needs), plus what is ready."""
    return ready + math.ceil((per_rank - ready) * (1 + over_sample_rate) - 1e-9)


def _every_shard_here(count: int) -> int:
    return count


def _counters() -> dict[str, float]:
    return {"generated": 0.0, "tokens": 0.0, "dropped": 0.0, "stale_dropped_responses": 0.0,
            "stale_dropped_tokens": 0.0}


def produce(run: Run, gen: Generation, prompts: Prompts, step: int, agree_min: Optional[Callable[[int], int]],
            reward_model=None) -> StepRollout:
    """Generate and score step `step`'s responses for every shard of `prompts` (see the module
    docstring)."""
    if agree_min is None:   # every shard is here: nothing to agree with
        agree_min = _every_shard_here
    spec, plan = run.spec, run.plan
    roll, dyn = spec.rollout, spec.algorithm.dynamic_sampling
    n, chunk = roll.responses_per_prompt, roll.partial_rollout_tokens
    server = roll.mode == "server"   # trajectories as coroutines; over-sampled ones are carried (server_round)
    carries = bool(chunk) or server
    per_rank = plan.prompts_per_rank
    started = time.perf_counter()
    carry = prompts.carry if carries else {}
    for d in prompts.shards:
        carry.setdefault(d, ShardCarry())
    counts = {d: _counters() for d in prompts.shards}
    scorings: dict[int, list] = {d: [] for d in prompts.shards}   # each scoring call's (stats, responses)
    oldest = step - 1 - roll.max_staleness   # the oldest policy version a trained response may start from

    def settle(d: int) -> None:
        """Score shard `d`'s finished groups and keep them (dynamic sampling, reward.on_error)."""
        c, st = carry[d], counts[d]
        done = [g for g in c.active if g.finished]
        c.active = [g for g in c.active if not g.finished]
        fresh = [g for g in done if g.prescored is None]
        judged: dict[int, tuple] = {}   # id(group) -> (scores, kept)
        if fresh:
            responses = [x for g in fresh for x in g.responses()]
            r = score(run, gen, [g.item for g in fresh], responses, n, step,
                      metric=dyn.metric if dyn.enable else None, reward_model=reward_model)
            scorings[d].append((r["stats"], len(responses)))
            keep, dropped = keep_groups_of(r, n, dyn.enable, spec.reward.on_error == "drop")
            st["dropped"] += dropped
            judged.update({id(g): (r["scores"][i * n:(i + 1) * n], keep[i]) for i, g in enumerate(fresh)})
        for g in done:
            if g.prescored is not None:   # scored and filtered as it finished (server mode)
                r, g.prescored = g.prescored[0], None
                if "filter_error" in r:
                    raise UserError(r["filter_error"])
                scorings[d].append((r["stats"], n))
                keep, dropped = keep_groups_of(r, n, dyn.enable, spec.reward.on_error == "drop")
                st["dropped"] += dropped
                judged[id(g)] = (r["scores"], keep[0])
        for g in done:
            scores, kept = judged[id(g)]
            if kept and (carries or len(c.ready) < per_rank):
                g.scored = {"scores": list(scores)}
                c.ready.append(g)

    together = server and roll.router == "driver"   # the driver runs every shard's round at once (mrl.train.driver)
    rounds = draws = 0
    while True:
        deferred = []
        for d in prompts.shards:
            c, st = carry[d], counts[d]
            seed = round_seed(roll.seed, step, rounds, d)
            if server:
                refresh_unstarted(c.active, gen.version)
            if carries:
                drop_stale(c, oldest, n, st)
            target = target_groups(per_rank, len(c.ready), roll.over_sample_rate) if server else per_rank
            while not carries or len(c.ready) + len(c.active) < target:   # whole: every round draws
                picked = prompts.samplers[d].next()
                draws += 1
                c.active += [GroupInProgress.new(prompts.dataset[i], n, gen.version) for i in picked.indices]
                if not carries:
                    break
            if server:   # submit the target's groups (reordered: first finished first); the rest wait unstarted
                k = max(target - len(c.ready), 0)
                submitted, waiting = c.active[:k], c.active[k:]
                judge = supply = None
                drawn = [0]
                if dyn.enable and reward_model is None and not spec.algorithm.gdpo_reward_keys:
                    room = (dyn.max_generation_batches * max(len(prompts.shards), 1) - draws
                            if dyn.max_generation_batches else None)
                    judge, supply, drawn = _in_flight_filter(run, gen, prompts, d, waiting, step, room)
                args = (submitted, per_rank - len(c.ready), seed, d, st, judge, supply)
                if together:
                    deferred.append((d, submitted, waiting, drawn, args))
                    continue
                server_round(run, gen, *args)
                draws += drawn[0]
                c.active = submitted + waiting
            elif chunk:
                advance(run, gen, c.active, chunk, seed, d, st)
            else:
                responses = generate(run, gen, [list(g.item.token_ids) for g in c.active],
                                     sampling_from_config(roll, seed=seed), dp_rank=d,
                                     images=[getattr(g.item, "images", None) for g in c.active])
                for x in responses:
                    x.policy_version = gen.version
                st["generated"] += len(responses)
                st["tokens"] += sum(len(x.token_ids) for x in responses)
                c.active = [GroupInProgress.generated(g.item, responses[i * n:(i + 1) * n])
                            for i, g in enumerate(c.active)]
            settle(d)
        if deferred:   # every shard's round at once over every engine group (rollout.router = "driver")
            server_rounds(run, gen, [args for *_, args in deferred])
            for d, submitted, waiting, drawn, _ in deferred:
                draws += drawn[0]
                carry[d].active = submitted + waiting
                settle(d)
        rounds += 1
        have = agree_min(min(len(carry[d].ready) for d in prompts.shards) if prompts.shards else per_rank)
        if have >= per_rank or not (dyn.enable or chunk):
            break
        shards = max(len(prompts.shards), 1)
        if dyn.max_generation_batches and draws >= dyn.max_generation_batches * shards and \
                agree_min(min(len(carry[d].active) for d in prompts.shards) if prompts.shards else 0) == 0:
            if dyn.on_exhausted == "error":
                what = "partial rollouts" if chunk else "dynamic sampling"
                raise UserError(f"step {step}: {what} kept {have} of {per_rank} prompts per rank after {rounds} "
                                "generation rounds (algorithm.dynamic_sampling.max_generation_batches)")
            break
    count = min(have, per_rank)
    if count == 0:
        raise UserError(f"step {step}: no prompt kept after {rounds} generation rounds")
    out, rewards = {}, reward_stats(scorings)
    for d in prompts.shards:
        c, st = carry[d], counts[d]
        taken, c.ready = c.ready[:count], c.ready[count:]
        stats = {**rewards[d], "rollout/generation_rounds": float(rounds),
                 "rollout/responses_generated": st["generated"], "tokens/rollout_response": st["tokens"]}
        if server:
            stats.update({"rollout/aborted": st.get("aborted", 0.0), "rollout/engine_busy": st.get("engine_busy", 0.0),
                          "rollout/carried": float(sum(f is None for g in c.active for f in g.finish))})
            if dyn.enable:   # groups dynamic sampling refused as they finished (each replaced at once)
                stats["rollout/dynamic_refused_groups"] = st.get("dynamic_rejected", 0.0)
        if carries:
            stats.update({"rollout/partial_tokens_carried": float(sum(sum(g.carried) for g in taken)),
                          "rollout/partial_groups_in_flight": float(len(c.active) + len(c.ready)),
                          "rollout/stale_dropped_responses": st["stale_dropped_responses"],
                          "rollout/stale_dropped_tokens": st["stale_dropped_tokens"]})
        if spec.reward.on_error == "drop":
            stats["reward/dropped_responses"] = st["dropped"]
        out[d] = ShardRollout(dp_rank=d, items=[g.item for g in taken],
                              responses=[x for g in taken for x in g.responses()],
                              scores=[s for g in taken for s in g.scored["scores"]], stats=stats,
                              version=min((v for g in taken for v in g.versions), default=gen.version))
        for g in c.active + c.ready:   # what continues next step was generated before it
            g.carried = [len(t) for t in g.tokens]
    if spec.algorithm.advantage == "remax":
        for d, shard in out.items():
            shard.greedy_scores = greedy_scores(run, gen, shard.items, step, d, reward_model)
    return StepRollout(step=step, version=gen.version, shards=out, position=prompts.position,
                       produce_s=time.perf_counter() - started, finished_at=time.time(),
                       carry=encode_carry(carry, {d: s.state_dict() for d, s in prompts.samplers.items()})
                       if carries else None)


def _in_flight_filter(run: Run, gen: Generation, prompts: Prompts, d: int, waiting: list, step: int,
                      room: Optional[int]):
    """Server mode with dynamic sampling: (judge, supply, drawn) for `server_round`. `judge`
    scores a group on the leader as it finishes and applies the filter; `supply` gives the group
    to start in place of a refused one: the next waiting group of shard `d`, else the first of a
    newly drawn batch (the rest wait), or None once `room` more batches were drawn
    (`max_generation_batches`; None: no limit). `drawn[0]` counts the batches drawn."""
    spec = run.spec
    n, dyn = spec.rollout.responses_per_prompt, spec.algorithm.dynamic_sampling
    drawn = [0]

    def judge(g, responses):
        r = leader_score(run, gen, [g.item], responses, n, step, metric=dyn.metric)
        if "filter_error" in r:
            return r, True   # raised on every rank by the producer
        return r, keep_groups_of(r, n, True, spec.reward.on_error == "drop")[0][0]

    def supply():
        if not waiting:
            if room is not None and drawn[0] >= room:
                return None
            picked = prompts.samplers[d].next()
            drawn[0] += 1
            waiting.extend(GroupInProgress.new(prompts.dataset[i], n, gen.version) for i in picked.indices)
        return waiting.pop(0)

    return judge, supply, drawn


def greedy_scores(run: Run, gen: Generation, items: list, step: int, dp_rank: int, reward_model=None) -> list[float]:
    """ReMax's baseline: the score of one greedy (temperature 0) response per prompt."""
    greedy = replace(sampling_from_config(run.spec.rollout), n=1, temperature=0.0)
    responses = generate(run, gen, [list(it.token_ids) for it in items], greedy, dp_rank=dp_rank,
                         images=[getattr(it, "images", None) for it in items])
    return [float(s) for s in score(run, gen, items, responses, 1, step, reward_model=reward_model)["scores"]]
