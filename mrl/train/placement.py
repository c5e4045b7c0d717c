"""What a job with its rollout on ranks of its own (`rollout.placement = "separate"`) or with
partial rollouts (`rollout.partial_rollout_tokens`) cannot do, in one place: `mrl validate`
reports these and `mrl train` refuses them before any compute.

The placement itself (how many ranks, how the engines divide them) is checked with the engine
layout in `mrl.rollout.layout`.
"""
from __future__ import annotations


def separate_problems(spec) -> list[tuple[str, str]]:
    """(dotted key, message) for every feature that needs the rollout and the trainer on the same
    ranks, when the job separates them."""
    roll = spec.rollout
    if roll.placement != "separate":
        return []
    out: list[tuple[str, str]] = []
    from mrl.reward.sources import reward_sources

    if any(s.kind == "model" for s in reward_sources(spec.reward, check_files=False)):
        out.append(("reward.model_path", "a reward model runs on the trainer's model-parallel ranks, but "
                                         "rollout.placement = 'separate' scores on the rollout ranks; use a "
                                         "colocated rollout or a reward function"))
    out += _idle_engine_groups(spec)
    return out


def _idle_engine_groups(spec) -> list[tuple[str, str]]:
    """Server mode with one router per engine-group leader (`rollout.router = "leader"`): engine
    group g of G generates for trainer data-parallel shards g, g + G, ..., and each shard's round
    ends in a wait over every rollout rank (`from_leader`), so every group must hold as many
    shards: otherwise (G does not divide the shards; a group with none among them) a group that
    is done waits in the rollout agreement for a round the others still run, until it times out.
    The driver's one router spreads every shard over every group."""
    from mrl.train.plan import plan_problems, step_plan

    roll = spec.rollout
    if roll.mode != "server" or roll.router != "leader" or plan_problems(spec):
        return []
    plan = step_plan(spec)
    groups, dp = plan.engine_groups, plan.dp
    if dp % groups == 0:
        return []
    return [("rollout.ranks", f"{roll.ranks} rollout ranks make {groups} engine groups for the trainer's {dp} "
                              "data-parallel shards, which they do not divide, so with rollout.mode = 'server' and "
                              "rollout.router = 'leader' the groups' rounds do not line up (a rollout rank times out "
                              "waiting); set rollout.router = 'driver' (one router over every group), or rollout.ranks "
                              "so the engine groups divide the shards")]


def partial_problems(spec) -> list[tuple[str, str]]:
    """(dotted key, message) for what partial rollouts cannot do; `mrl validate` and `mrl train`
    both apply it."""
    from mrl.train.driver import driver_problems

    roll = spec.rollout
    chunk = roll.partial_rollout_tokens
    out: list[tuple[str, str]] = driver_problems(spec)
    if roll.mode == "server" and spec.actor.moe.routing_replay == "r3":
        out.append(("actor.moe.routing_replay", "'r3' needs the engine's routes, which server mode does not return yet; "
                                                "use rollout.mode = 'spmd'"))
    if roll.over_sample_rate and roll.mode == "server":
        if roll.max_staleness < 1:
            out.append(("rollout.max_staleness", "is 0, but over-sampling carries aborted trajectories to the next step, "
                                                 "where they continue under newer weights; set it >= 1"))
        if spec.algorithm.advantage == "remax":
            out.append(("rollout.over_sample_rate", "ReMax's greedy baseline is generated whole within the step; use "
                                                    "another estimator or set 0"))
    if not chunk:
        return out
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
