"""The groups a data-parallel shard has in hand after a step, as they cross steps and
checkpoints: the producer (`mrl.train.produce`) hands them to the next step, and a checkpoint
stores them.

A group is one prompt's `responses_per_prompt` responses (`mrl.train.groups`). With partial
rollouts (`rollout.partial_rollout_tokens` = C > 0) each round advances every unfinished response
by at most C tokens (`mrl.train.rollout.advance`); with server mode (`rollout.mode = "server"`)
over-sampled trajectories are aborted and continue later. A carried response holds tokens of
several policy versions; each token's behaviour log-prob is the engine's at the time it was
generated, which is what the importance-sampling corrections need (`algorithm.correction`). A
response is as old as its first token (`versions`; the producer drops the stale ones,
`mrl.train.produce.drop_stale`).

The groups in hand after a step (groups still generating, and finished groups beyond the batch)
are part of the data position: checkpoints store them (`encode_carry` / `decode_carry`, plain
values) and a resumed run continues them exactly. Each shard's groups are stored with its
sampler's position (a shard draws when its own groups in hand run short, so the shards' positions
can differ), every shard's in one checkpoint (each rank of a data-parallel trainer holds only its
own: the saver gathers them) and each rank restores its own (`restore_shards`).
"""
from __future__ import annotations

from typing import Optional

from mrl.errors import UserError
from mrl.train.groups import GroupInProgress, ShardCarry

__all__ = ["GroupInProgress", "ShardCarry", "encode_carry", "decode_carry", "merge_carries", "restore_shards"]


def encode_carry(carry: dict[int, ShardCarry], positions: Optional[dict[int, dict]] = None) -> dict:
    """The groups in hand as plain values (checkpoints are read with `weights_only=True`), each
    shard's with its sampler's position when `positions` (shard -> `PromptSampler.state_dict()`)
    has it."""
    def group(g: GroupInProgress) -> dict:
        return {"item": g.item.index, "tokens": [list(t) for t in g.tokens], "logprobs": [list(x) for x in g.logprobs],
                "finish": [f or "" for f in g.finish], "versions": list(g.versions), "carried": list(g.carried),
                "scores": list(g.scored["scores"]) if g.scored else None,
                "routes": list(g.routes), "masks": [list(m) for m in g.masks], "infos": [dict(i) for i in g.infos]}

    out = {}
    for d, c in carry.items():
        out[str(d)] = {"active": [group(g) for g in c.active], "ready": [group(g) for g in c.ready]}
        if positions and d in positions:
            out[str(d)]["position"] = dict(positions[d])
    return out


def merge_carries(parts: list) -> dict:
    """One encoded carry of every shard from several ranks' (`encode_carry` of their own shards),
    in rank order: a shard several ranks hold (the ranks of one model-parallel group, or the
    driver's copy) is the first's."""
    merged: dict = {}
    for part in parts:
        for d, c in (part or {}).items():
            merged.setdefault(d, c)
    return merged


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


def restore_shards(prompts, position: Optional[dict], encoded: Optional[dict]) -> str:
    """Load a checkpoint's data position (`position`, the run's) and groups in hand (`encoded`,
    every shard's) into `prompts`, this rank's shards only, each shard's sampler at its own saved
    position when the checkpoint has one. A checkpoint whose groups in hand belong to another
    number of data-parallel shards is refused (a shard's groups and position are its own; they
    cannot be dealt to other shards without changing what each shard trains next).
    -> a line saying what was restored ("" when nothing is in hand)."""
    saved = decode_carry(encoded, prompts.dataset)
    if not prompts.samplers:
        return ""
    dp = next(iter(prompts.samplers.values())).dp_size
    held = sorted(d for d, c in saved.items() if c.active or c.ready)
    same = set(saved) == set(range(dp))
    if held and not same and all("position" in e for e in encoded.values()):
        raise UserError(f"checkpoint: it holds groups in hand (rollout.over_sample_rate / partial_rollout_tokens) of "
                        f"{len(saved)} data-parallel shards, this run has {dp}; resume with {len(saved)} "
                        "data-parallel ranks, or start a new run from its weights (checkpoint.load_from)")
    for d, sampler in prompts.samplers.items():
        own = (encoded or {}).get(str(d), {}).get("position") if same else None
        if own is not None or position is not None:
            sampler.load_state_dict(own if own is not None else position)
    prompts.carry = {d: saved[d] for d in prompts.samplers if d in saved}
    groups = [g for c in prompts.carry.values() for g in c.active + c.ready]
    if not groups:
        return ""
    unfinished = [t for g in groups for t, f in zip(g.tokens, g.finish) if f is None]
    return (f"{len(groups)} groups in hand restored ({len(unfinished)} trajectories unfinished, "
            f"{sum(len(t) for t in unfinished)} of their tokens generated)")
