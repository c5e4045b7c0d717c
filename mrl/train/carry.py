"""The groups a data-parallel shard has in hand while the producer (`mrl.train.produce`) fills a
step's batch, and what of them crosses steps and checkpoints.

A group is one prompt's `responses_per_prompt` responses. With whole generation a group is
generated in one call and finishes at once; with partial rollouts (`rollout.partial_rollout_tokens`
= C > 0) each round advances every unfinished response by at most C tokens (`advance`), and the
group finishes when all of its responses have.

A carried response holds tokens of several policy versions; each token's behaviour log-prob is
the engine's at the time it was generated, which is what the importance-sampling corrections
need (`algorithm.correction`). A response is as old as its first token (`versions`).

The groups in hand after a step (partial rollouts only: groups still generating, and finished
groups beyond the batch) are part of the data position: checkpoints store them (`encode_carry` /
`decode_carry`, plain values) and a resumed run continues them exactly.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from mrl.rollout.types import Response, sampling_from_config  # noqa: F401 - Response: decode_carry
from mrl.train.groups import GroupInProgress, ShardCarry
from mrl.train.rollout import generate

__all__ = ["GroupInProgress", "ShardCarry", "advance", "drop_stale", "encode_carry", "decode_carry"]


def advance(run, gen, active: list[GroupInProgress], chunk: int, seed: int, dp_rank: int, st: dict) -> None:
    """Advance every unfinished response of `active` by at most `chunk` tokens: one generate call
    per distinct budget (`chunk`, or what is left of `rollout.max_response_tokens`)."""
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
        out = generate(run, gen, [list(g.item.token_ids) + g.tokens[j] for g, j in todo], sampling, dp_rank=dp_rank,
                       images=[getattr(g.item, "images", None) for g, _ in todo])   # a carried response keeps them
        for (g, j), r in zip(todo, out):
            g.tokens[j] += r.token_ids
            g.logprobs[j] += r.logprobs
            if g.routes:   # the call fed prompt + every token so far: its routes cover them all
                g.routes[j] = r.routes
            st["generated"] += 1
            st["tokens"] += len(r.token_ids)
            if r.finish_reason == "stop":
                g.finish[j] = "stop"
            elif len(g.tokens[j]) >= limit:
                g.finish[j] = "length"


def drop_stale(c: ShardCarry, oldest: int, n: int, st: dict) -> None:
    """Drop the groups whose oldest response began before policy version `oldest` (it would lag
    the trained policy by more than `rollout.max_staleness`), counting them in `st`."""
    for pool in (c.active, c.ready):
        for g in [g for g in pool if min(g.versions) < oldest]:
            pool.remove(g)
            st["stale_dropped_responses"] += n
            st["stale_dropped_tokens"] += sum(len(t) for t in g.tokens)


# ---------------------------------------------------------------------------- in checkpoints

def encode_carry(carry: dict[int, ShardCarry]) -> dict:
    """The groups in hand as plain values (checkpoints are read with `weights_only=True`)."""
    def group(g: GroupInProgress) -> dict:
        return {"item": g.item.index, "tokens": [list(t) for t in g.tokens], "logprobs": [list(x) for x in g.logprobs],
                "finish": [f or "" for f in g.finish], "versions": list(g.versions), "carried": list(g.carried),
                "scores": list(g.scored["scores"]) if g.scored else None,
                "routes": list(g.routes), "masks": [list(m) for m in g.masks], "infos": [dict(i) for i in g.infos]}

    return {str(d): {"active": [group(g) for g in c.active], "ready": [group(g) for g in c.ready]}
            for d, c in carry.items()}


def decode_carry(encoded: Optional[dict], dataset) -> dict[int, ShardCarry]:
    def group(e: dict) -> GroupInProgress:
        return GroupInProgress(item=dataset[e["item"]], tokens=[list(t) for t in e["tokens"]],
                               logprobs=[list(x) for x in e["logprobs"]], finish=[f or None for f in e["finish"]],
                               versions=list(e["versions"]), carried=list(e["carried"]),
                               scored={"scores": list(e["scores"])} if e["scores"] is not None else None,
                               routes=list(e.get("routes") or [None] * len(e["finish"])),
                               masks=[list(m) for m in e.get("masks") or []], infos=[dict(i) for i in e.get("infos") or []])

    return {int(d): ShardCarry(active=[group(g) for g in c["active"]], ready=[group(g) for g in c["ready"]])
            for d, c in (encoded or {}).items()}
