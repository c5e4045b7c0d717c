"""What a job with its rollout on ranks of its own (`rollout.placement = "separate"`) cannot do,
in one place: `mrl validate` reports these and `mrl train` refuses them before any compute.

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
    if spec.algorithm.advantage == "remax":
        out.append(("algorithm.advantage", "'remax' generates a greedy baseline inside the training step, which needs "
                                           "the engine on the trainer's ranks; use rollout.placement = 'colocated'"))
    return out
