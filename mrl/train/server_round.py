"""One generation round of server mode (`rollout.mode = "server"`) for one data-parallel shard.

The shard's groups in hand (`ShardCarry.active`: new groups, and groups carried from earlier
steps with some trajectories aborted) are run on the leader's `ServerRollout`, every unfinished
trajectory its own coroutine (`mrl.rollout.agent_loop`); a carried trajectory continues from its
tokens (`resume`). With `rollout.over_sample_rate`, once `need` groups have finished the rest are
aborted: their trajectories keep what they generated and stay in `active`, carried to the next
step under the partial-rollout rules (`mrl.train.produce`: a response is as old as its first token,
`drop_stale` applies `rollout.max_staleness`; the producer stamps the trajectories not yet started
with the policy that starts them, `refresh_unstarted`, before it submits a round). The leader
broadcasts the round's outcome to its group (`from_leader`), so every rank of it holds the same groups.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

from mrl.platform.collectives import from_leader
from mrl.rollout.types import Response, prompt_seed, sampling_from_config
from mrl.train.groups import GroupInProgress


def server_round(run, gen, active: list[GroupInProgress], need: int, seed: int, dp_rank: int, st: dict,
                 judge: Optional[Callable] = None, supply: Optional[Callable] = None) -> None:
    """One shard's round (`_round`)."""
    server_rounds(run, gen, [(active, need, seed, dp_rank, st, judge, supply)])


def server_rounds(run, gen, rounds: list[tuple]) -> None:
    """Several shards' rounds at once (each the arguments of `server_round` after `gen`): their
    trajectories run together on the leader's `ServerRollout` (`run_many`, one budget per shard),
    so with one router over every engine group (`rollout.router = "driver"`) no shard's tail
    holds the engines the others could use. Each round's outcome then reaches its group in order."""
    steps = [_round(run, gen, *r) for r in rounds]
    calls = [next(s) for s in steps]
    results = gen.generator.run_many(calls) if gen.is_leader else [None] * len(steps)
    for s, result in zip(steps, results):
        try:
            s.send(result)
        except StopIteration:
            continue
        raise RuntimeError("a server round asked for a second run")


def _round(run, gen, active: list[GroupInProgress], need: int, seed: int, dp_rank: int, st: dict,
           judge: Optional[Callable] = None, supply: Optional[Callable] = None):
    """Run `active`'s unfinished trajectories (a generator: it yields the leader's `run_groups`
    arguments, None elsewhere, and takes the result); with over-sampling, abort the rest once `need`
    groups finished. Updates the groups in place and the counters `st` (generated, tokens,
    aborted, engine_busy, dynamic_rejected).

    Dynamic sampling in flight (`judge`, on the leader: `judge(group, responses) -> (scored,
    keep)`): each group is scored and filtered as it finishes; a refused group does not count
    toward `need`, and `supply()` (every rank: the next group to start, appended to `active`, or
    None) starts another in its place at once. The scores travel with the outcome
    (`GroupInProgress.prescored`), so the producer does not score those groups again."""
    from mrl.rollout.server import response_info

    roll = run.spec.rollout
    n = roll.responses_per_prompt
    groups = list(active)
    work = [(gi, g, j) for gi, g in enumerate(groups) for j in range(n) if g.finish[j] is None]
    outcome = call = None
    if gen.is_leader:
        from mrl.rollout.agent_loop import Trajectory, TrajectorySpec

        def spec_of(gi: int, g: GroupInProgress, j: int) -> TrajectorySpec:
            resume = None
            if g.tokens[j] or (g.infos and g.infos[j]):
                resume = Trajectory(list(g.tokens[j]), list(g.logprobs[j]),
                                    list(g.masks[j]) if g.masks else [1] * len(g.tokens[j]),
                                    info=dict(g.infos[j]) if g.infos else {})
            return TrajectorySpec(f"s{seed}d{dp_rank}g{gi}r{j}", gi, list(g.item.token_ids),
                                  seed=prompt_seed(seed, gi * n + j) % 2**31, resume=resume,
                                  images=getattr(g.item, "images", None))   # a resumed one keeps its prompt's images

        prescored: dict[int, tuple] = {}

        def accept(gi: int, trajectories) -> bool:
            g, new = groups[gi], iter(trajectories)
            responses = []
            for j in range(n):
                if g.finish[j] is not None:   # finished in an earlier round
                    responses.append(Response(0, list(g.tokens[j]), list(g.logprobs[j]), g.finish[j]))
                else:
                    t = next(new)
                    responses.append(Response(0, list(t.token_ids), list(t.logprobs), t.finish_reason,
                                              loss_mask=list(t.loss_mask), info=response_info(t.info)))
            prescored[gi] = judge(g, responses)
            return prescored[gi][1]

        def more() -> list:
            g = supply()
            if g is None:
                return []
            groups.append(g)
            return [spec_of(len(groups) - 1, g, j) for j in range(n)]

        specs = [spec_of(gi, g, j) for gi, g, j in work]
        sampling = replace(sampling_from_config(roll), n=1, seed=None)
        budgeted = bool(roll.over_sample_rate) or judge is not None
        call = (specs, sampling, need if budgeted else None, accept if judge is not None else None,
                more if judge is not None and supply is not None else None)
    result = yield call
    if gen.is_leader:
        outcome = ([(t.token_ids, t.logprobs, t.loss_mask, t.finish_reason, t.info) for t in result.trajectories],
                   result.aborted, result.engine_busy, result.finished_groups if budgeted else list(range(len(groups))),
                   len(groups) - len(active),
                   [prescored.get(gi) for gi in range(len(groups))])
    trajectories, aborted, busy, order, supplied, scored = from_leader(outcome, gen.mp_group, gen.is_leader,
                                                                       "server-mode rollouts")
    if not gen.is_leader:   # the same groups, drawn in the same order
        for _ in range(supplied):
            groups.append(supply())
    for gi in range(len(active), len(groups)):   # the groups started in place of refused ones
        active.append(groups[gi])
        work += [(gi, groups[gi], j) for j in range(n)]
    position = {id(g): gi for gi, g in enumerate(groups)}
    for (gi, g, j), (ids, lps, mask, reason, info) in zip(work, trajectories):
        if not g.masks:
            g.masks = [[1] * len(t) for t in g.tokens]
            g.infos = [{} for _ in g.tokens]
        st["tokens"] += len(ids) - len(g.tokens[j])
        g.tokens[j], g.logprobs[j], g.masks[j], g.infos[j] = list(ids), list(lps), list(mask), dict(info)
        if reason != "abort":
            g.finish[j] = reason
            st["generated"] += 1
    for g, pre in zip(groups, scored):
        g.prescored = pre
    # with a budget the groups that finished first come first (they make the batch; the producer scores
    # in this order); without one every group is kept, in the order submitted (finishing order depends
    # on timing once engines run in other processes, rollout.router = "driver")
    rank = {gi: k for k, gi in enumerate(order)}
    active.sort(key=lambda g: rank.get(position[id(g)], len(order)))
    st["aborted"] = st.get("aborted", 0.0) + aborted
    st["dynamic_rejected"] = st.get("dynamic_rejected", 0.0) + sum(1 for pre in scored if pre is not None and not pre[1])
    st["engine_busy"] = busy
