"""One generation round of server mode (`rollout.mode = "server"`) for one data-parallel shard.

The shard's groups in hand (`ShardCarry.active`: new groups, and groups carried from earlier
steps with some trajectories aborted) are run on the leader's `ServerRollout`, every unfinished
trajectory its own coroutine (`mrl.rollout.agent_loop`); a carried trajectory continues from its
tokens (`resume`). With `rollout.over_sample_rate`, once `need` groups have finished the rest are
aborted: their trajectories keep what they generated and stay in `active`, carried to the next
step under the partial-rollout rules (`mrl.train.carry`: a response is as old as its first token,
`drop_stale` applies `rollout.max_staleness`). The leader broadcasts the round's outcome to its
group (`from_leader`), so every rank of it holds the same groups.
"""
from __future__ import annotations

import math
from dataclasses import replace

from mrl.platform.collectives import from_leader
from mrl.rollout.types import prompt_seed, sampling_from_config
from mrl.train.groups import GroupInProgress


def target_groups(per_rank: int, ready: int, over_sample_rate: float) -> int:
    """Groups a shard keeps in hand (ready + generating) for a step of `per_rank` groups:
    ceil((1 + rate) x what it still needs), plus what is ready."""
    return ready + math.ceil((per_rank - ready) * (1 + over_sample_rate) - 1e-9)


def refresh_unstarted(active: list[GroupInProgress], version: int) -> None:
    """Trajectories in hand that have not generated a token yet (drawn beyond the submitted target,
    or aborted before their first token) are as new as the policy that will start them: `version`
    (so `drop_stale` never drops a prompt that has not been tried)."""
    for g in active:
        for j, tokens in enumerate(g.tokens):
            if not tokens and g.finish[j] is None:
                g.versions[j] = version


def server_round(run, gen, active: list[GroupInProgress], need: int, seed: int, dp_rank: int, st: dict) -> None:
    """Run `active`'s unfinished trajectories; with over-sampling, abort the rest once `need`
    groups finished. Updates the groups in place and the counters `st` (generated, tokens,
    aborted, engine_busy)."""
    roll = run.spec.rollout
    n = roll.responses_per_prompt
    refresh_unstarted(active, gen.version)   # a trajectory is as old as its first token
    position = {id(g): gi for gi, g in enumerate(active)}
    work = [(gi, g, j) for gi, g in enumerate(active) for j in range(n) if g.finish[j] is None]
    outcome = None
    if gen.is_leader:
        from mrl.rollout.agent_loop import Trajectory, TrajectorySpec

        specs = []
        for gi, g, j in work:
            resume = None
            if g.tokens[j] or (g.infos and g.infos[j]):
                resume = Trajectory(list(g.tokens[j]), list(g.logprobs[j]),
                                    list(g.masks[j]) if g.masks else [1] * len(g.tokens[j]),
                                    info=dict(g.infos[j]) if g.infos else {})
            specs.append(TrajectorySpec(f"s{seed}d{dp_rank}g{gi}r{j}", gi, list(g.item.token_ids),
                                        seed=prompt_seed(seed, gi * n + j) % 2**31, resume=resume))
        sampling = replace(sampling_from_config(roll), n=1, seed=None)
        result = gen.generator.run_groups(specs, sampling, need if roll.over_sample_rate else None)
        outcome = ([(t.token_ids, t.logprobs, t.loss_mask, t.finish_reason, t.info) for t in result.trajectories],
                   result.aborted, result.engine_busy, result.finished_groups)
    trajectories, aborted, busy, order = from_leader(outcome, gen.mp_group, gen.is_leader, "server-mode rollouts")
    for (gi, g, j), (ids, lps, mask, reason, info) in zip(work, trajectories):
        if not g.masks:
            g.masks = [[1] * len(t) for t in g.tokens]
            g.infos = [{} for _ in g.tokens]
        st["tokens"] += len(ids) - len(g.tokens[j])
        g.tokens[j], g.logprobs[j], g.masks[j], g.infos[j] = list(ids), list(lps), list(mask), dict(info)
        if reason != "abort":
            g.finish[j] = reason
            st["generated"] += 1
    # the groups that finished first come first (they make the batch; the producer scores in this order)
    rank = {gi: k for k, gi in enumerate(order)}
    active.sort(key=lambda g: rank.get(position[id(g)], len(order)))
    st["aborted"] = st.get("aborted", 0.0) + aborted
    st["engine_busy"] = busy
