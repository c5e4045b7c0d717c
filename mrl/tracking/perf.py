"""Throughput of a step from its reduced metrics: tokens per second for the rollout and the update.

Each rank reports what it processed (`tokens/rollout_response`: response tokens it generated in
every generation round of the step; `tokens/actor_update`: prompt + response tokens of its batch
times the actor's epochs). After the reduction those are means over data-parallel ranks and stage
times are maxima over all ranks, so the whole job's rate is `mean x dp / max time`.
"""
from __future__ import annotations

from typing import Mapping


def throughput(metrics: Mapping[str, float], dp: int) -> dict[str, float]:
    """`throughput/rollout_tokens_per_s` and `throughput/train_tokens_per_s` (the whole job's)."""
    out = {}
    for name, tokens, seconds in (("rollout", "tokens/rollout_response", "time/rollout"),
                                  ("train", "tokens/actor_update", "time/actor_update")):
        if tokens in metrics and metrics.get(seconds, 0.0) > 0:
            out[f"throughput/{name}_tokens_per_s"] = metrics[tokens] * dp / metrics[seconds]
    return out
