"""Partial rollouts (`rollout.partial_rollout_tokens` = C > 0): long generations are not waited
for, and not wasted.

Generation runs in rounds. Each round advances every unfinished response of a data-parallel
shard by at most C tokens (the prompt and the response so far are the engine's prompt; the
engine's log-prob of every new token is kept), scores the groups whose responses have all
finished, and keeps them (dynamic sampling applies as usual). As soon as every shard holds
`prompts_per_step / DP` kept groups, the step's batch is complete: groups still generating are
carried over to the next step, where they continue with the newer weights, and kept groups
beyond the batch wait for the next step too. New prompts are drawn only when the groups in
hand cannot complete the batch.

A carried response holds tokens of several policy versions; each token's behaviour log-prob is
the engine's at the time it was generated, which is what the importance-sampling corrections
need (`algorithm.correction`). A response is as old as its first token: a group whose oldest
response would lag the trained policy by more than `rollout.max_staleness` versions is dropped
and counted (`rollout/stale_dropped_responses`, with its tokens in
`rollout/stale_dropped_tokens`). `rollout/partial_tokens_carried` counts the tokens of the
step's responses that earlier steps generated: the generation a step-synchronous rollout would
have waited for, or (aborting at the deadline) thrown away.

The groups in hand are part of the data position: checkpoints store them
(`encode_carry` / `decode_carry`) and a resumed run continues them exactly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch

from mrl.algos.dapo import keep_groups
from mrl.errors import UserError
from mrl.reward.compose import is_count
from mrl.rollout.types import Response, sampling_from_config
from mrl.train.parts import Generation, Prompts, Run


@dataclass
class GroupInProgress:
    """One prompt's `responses_per_prompt` responses while they are generated."""

    item: object                                   # the PromptItem
    tokens: list[list[int]]
    logprobs: list[list[float]]
    finish: list[Optional[str]]                    # None while generating
    versions: list[int]                            # the policy version of each response's first token
    carried: list[int] = field(default_factory=list)   # tokens each response brought from earlier steps
    scored: Optional[dict] = None                  # once finished: scores, filter values, validity

    @property
    def finished(self) -> bool:
        return all(f is not None for f in self.finish)


@dataclass
class ShardCarry:
    """What a shard has in hand between steps: groups generating, and kept groups not yet trained."""

    active: list[GroupInProgress] = field(default_factory=list)
    ready: list[GroupInProgress] = field(default_factory=list)


def produce_partial(run: Run, gen: Generation, prompts: Prompts, step: int, agree_min: Callable[[int], int],
                    reward_model=None):
    """`mrl.train.rollout.produce` with partial rollouts (see the module docstring)."""
    from mrl.train.rollout import ShardRollout, StepRollout, round_seed, score

    spec = run.spec
    roll, dyn = spec.rollout, spec.algorithm.dynamic_sampling
    n, chunk, k = roll.responses_per_prompt, roll.partial_rollout_tokens, roll.max_staleness
    per_rank = spec.data.prompts_per_step // run.dp
    started = time.perf_counter()
    carry = prompts.carry
    for d in prompts.shards:
        carry.setdefault(d, ShardCarry())
    stats = {d: {"stale_dropped_responses": 0.0, "stale_dropped_tokens": 0.0, "generated": 0.0, "tokens": 0.0,
                 "dropped": 0.0} for d in prompts.shards}
    reward_stats: dict[int, dict[str, float]] = {d: {} for d in prompts.shards}
    oldest = step - 1 - k   # the oldest policy version a trained response may start from
    rounds = draws = 0
    while True:
        for d in prompts.shards:
            c, st = carry[d], stats[d]
            # stale groups (generation began more than max_staleness versions ago) are dropped
            for pool in (c.active, c.ready):
                for g in [g for g in pool if min(g.versions) < oldest]:
                    pool.remove(g)
                    st["stale_dropped_responses"] += n
                    st["stale_dropped_tokens"] += sum(len(t) for t in g.tokens)
            if len(c.ready) + len(c.active) < per_rank:   # the groups in hand cannot fill the batch
                picked = prompts.samplers[d].next()
                draws += 1
                c.active += [GroupInProgress(item=prompts.dataset[i], tokens=[[] for _ in range(n)],
                                             logprobs=[[] for _ in range(n)], finish=[None] * n,
                                             versions=[gen.version] * n, carried=[0] * n)
                             for i in picked.indices]
            _advance(run, gen, c.active, chunk, round_seed(roll.seed, step, rounds, d), d, st)
            done = [g for g in c.active if g.finished]
            c.active = [g for g in c.active if not g.finished]
            if done:
                items = [g.item for g in done]
                responses = [_response(g, j) for g in done for j in range(n)]
                r = score(run, gen, items, responses, n, step, metric=dyn.metric if dyn.enable else None,
                          reward_model=reward_model)
                _accumulate(reward_stats[d], r["stats"], len(responses))
                groups = torch.arange(len(done)).repeat_interleave(n)
                keep = (keep_groups(torch.tensor(r["filter_values"], dtype=torch.float64), groups) if dyn.enable
                        else torch.ones(len(responses), dtype=torch.bool))
                if spec.reward.on_error == "drop":
                    valid = torch.tensor(r["valid"], dtype=torch.bool).view(-1, n).all(dim=1).repeat_interleave(n)
                    keep &= valid
                    st["dropped"] += float((~valid).sum())
                for i, g in enumerate(done):
                    if keep[i * n]:
                        g.scored = {"scores": r["scores"][i * n:(i + 1) * n]}
                        c.ready.append(g)
        rounds += 1
        have = agree_min(min(len(carry[d].ready) for d in prompts.shards) if prompts.shards else per_rank)
        if have >= per_rank:
            break
        if dyn.max_generation_batches and draws >= dyn.max_generation_batches * max(len(prompts.shards), 1) \
                and agree_min(min(len(carry[d].active) for d in prompts.shards) if prompts.shards else 0) == 0:
            if dyn.on_exhausted == "error" or have == 0:
                raise UserError(f"step {step}: partial rollouts kept {have} of {per_rank} prompts per rank after "
                                f"{draws} generation batches (algorithm.dynamic_sampling.max_generation_batches)")
            break
    count = min(have, per_rank)
    shards = {}
    for d in prompts.shards:
        c, st = carry[d], stats[d]
        taken, c.ready = c.ready[:count], c.ready[count:]
        responses = [_response(g, j) for g in taken for j in range(n)]
        carried_tokens = sum(sum(g.carried) for g in taken)
        out_stats = {**_finish(reward_stats[d]), "rollout/generation_rounds": float(rounds),
                     "rollout/responses_generated": st["generated"], "tokens/rollout_response": st["tokens"],
                     "rollout/partial_tokens_carried": float(carried_tokens),
                     "rollout/partial_groups_in_flight": float(len(c.active) + len(c.ready)),
                     "rollout/stale_dropped_responses": st["stale_dropped_responses"],
                     "rollout/stale_dropped_tokens": st["stale_dropped_tokens"]}
        if spec.reward.on_error == "drop":
            out_stats["reward/dropped_responses"] = st["dropped"]
        shards[d] = ShardRollout(dp_rank=d, items=[g.item for g in taken], responses=responses,
                                 scores=[s for g in taken for s in g.scored["scores"]], stats=out_stats,
                                 version=min((v for g in taken for v in g.versions), default=gen.version))
        for g in c.active + c.ready:   # what continues next step was generated before it
            g.carried = [len(t) for t in g.tokens]
    return StepRollout(step=step, version=gen.version, shards=shards, position=prompts.position,
                       produce_s=time.perf_counter() - started, finished_at=time.time(),
                       carry=encode_carry(carry))


def _accumulate(acc: dict, stats: dict[str, float], responses: int) -> None:
    """Add one scoring call's statistics: counts and times add up; means are weighted by the
    responses scored (one step scores in several calls, as groups finish)."""
    for key, v in stats.items():
        if is_count(key) or key.startswith("time/"):
            acc[key] = acc.get(key, 0.0) + float(v)
        elif v == v:   # not NaN
            total, weight = acc.get(("mean", key), (0.0, 0))
            acc[("mean", key)] = (total + float(v) * responses, weight + responses)


def _finish(acc: dict) -> dict[str, float]:
    return {k[1] if isinstance(k, tuple) else k: (v[0] / v[1] if isinstance(k, tuple) else v) for k, v in acc.items()}


def _response(g: GroupInProgress, j: int) -> Response:
    return Response(prompt_index=0, token_ids=list(g.tokens[j]), logprobs=list(g.logprobs[j]),
                    finish_reason=g.finish[j], policy_version=g.versions[j])


def _advance(run: Run, gen: Generation, active: list[GroupInProgress], chunk: int, seed: int, dp_rank: int,
             st: dict) -> None:
    """Advance every unfinished response of `active` by at most `chunk` tokens: one generate call
    per distinct budget (`chunk`, or what is left of `rollout.max_response_tokens`)."""
    from mrl.train.rollout import generate

    roll = run.spec.rollout
    limit = roll.max_response_tokens
    work = [(g, j) for g in active for j in range(len(g.finish)) if g.finish[j] is None]
    by_budget: dict[int, list] = {}
    for g, j in work:
        by_budget.setdefault(min(chunk, limit - len(g.tokens[j])), []).append((g, j))
    base = sampling_from_config(roll, seed=seed)
    for budget in sorted(by_budget):
        todo = by_budget[budget]
        sampling = replace(base, n=1, max_tokens=budget, seed=(seed * 7919 + budget) % 2**31)
        out = generate(run, gen, [list(g.item.token_ids) + g.tokens[j] for g, j in todo], sampling, dp_rank=dp_rank)
        for (g, j), r in zip(todo, out):
            g.tokens[j] += r.token_ids
            g.logprobs[j] += r.logprobs
            st["generated"] += 1
            st["tokens"] += len(r.token_ids)
            if r.finish_reason == "stop":
                g.finish[j] = "stop"
            elif len(g.tokens[j]) >= limit:
                g.finish[j] = "length"


# ---------------------------------------------------------------------------- in checkpoints

def encode_carry(carry: dict[int, ShardCarry]) -> dict:
    """The groups in hand as plain values (checkpoints are read with `weights_only=True`)."""
    def group(g: GroupInProgress) -> dict:
        return {"item": g.item.index, "tokens": [list(t) for t in g.tokens], "logprobs": [list(x) for x in g.logprobs],
                "finish": [f or "" for f in g.finish], "versions": list(g.versions), "carried": list(g.carried),
                "scores": list(g.scored["scores"]) if g.scored else None}

    return {str(d): {"active": [group(g) for g in c.active], "ready": [group(g) for g in c.ready]}
            for d, c in carry.items()}


def decode_carry(encoded: dict, dataset) -> dict[int, ShardCarry]:
    def group(e: dict) -> GroupInProgress:
        return GroupInProgress(item=dataset[e["item"]], tokens=[list(t) for t in e["tokens"]],
                               logprobs=[list(x) for x in e["logprobs"]], finish=[f or None for f in e["finish"]],
                               versions=list(e["versions"]), carried=list(e["carried"]),
                               scored={"scores": list(e["scores"])} if e["scores"] is not None else None)

    return {int(d): ShardCarry(active=[group(g) for g in c["active"]], ready=[group(g) for g in c["ready"]])
            for d, c in (encoded or {}).items()}


def partial_problems(spec) -> list[tuple[str, str]]:
    """(dotted key, message) for what partial rollouts cannot do; `mrl validate` and `mrl train`
    both apply it."""
    roll = spec.rollout
    chunk = roll.partial_rollout_tokens
    if not chunk:
        return []
    out: list[tuple[str, str]] = []
    if roll.max_staleness < 1:
        out.append(("rollout.max_staleness", "is 0, but partial rollouts carried over to the next step continue under "
                                             "newer weights and lag at least one version; set it >= 1"))
    if chunk >= roll.max_response_tokens:
        out.append(("rollout.partial_rollout_tokens", f"{chunk} >= rollout.max_response_tokens {roll.max_response_tokens}: "
                                                      "every response would finish in its first round; lower it or set 0"))
    if roll.multi_turn.enable:
        out.append(("rollout.partial_rollout_tokens", "partial rollouts continue single-turn responses; multi-turn "
                                                      "conversations (rollout.multi_turn.enable) run to their end"))
    if spec.algorithm.advantage == "remax":
        out.append(("rollout.partial_rollout_tokens", "ReMax's greedy baseline is generated whole within the step; "
                                                      "use another estimator or set 0"))
    return out
