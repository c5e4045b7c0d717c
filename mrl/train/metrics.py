"""How a step's metrics combine, by key, in one place: over the scoring calls of one step
(`RewardStats`, `reward_stats`) and over ranks (`reduce_over_ranks`).

A metric is one of three kinds (`kind`):
- "sum": events counted (`mrl.reward.compose.is_count`: errors, dropped responses, calls; and the
  multi-turn tool counts `tools/*`) add up over a step's scoring calls and over data-parallel
  replicas, each of which generated its own responses;
- "max": times (`time/*`), peak memory (`memory/*`) and `*_max` values: a stage takes as long as
  its slowest rank, and times add up over a step's scoring calls;
- "mean": everything else.

Reward means within one step are **response-weighted**: a step scores its responses in one call
(whole generation, one round), in several rounds (dynamic sampling) or as groups finish (partial
rollouts), and `reward/mean` is the mean over every response scored in the step whichever way it
ran, so the same metric means the same thing with and without `rollout.partial_rollout_tokens`.
"""
from __future__ import annotations

import math

from mrl.reward.compose import is_count


def kind(key: str) -> str:
    """"sum", "max" or "mean" (see the module docstring)."""
    if is_count(key) or key.startswith("tools/"):
        return "sum"
    if key.endswith("_max") or key.startswith(("time/", "memory/")):
        return "max"
    return "mean"


class RewardStats:
    """The reward statistics of one shard's step, accumulated over its scoring calls: counts and
    times add up; means are weighted by the responses each call scored (NaN means are skipped)."""

    def __init__(self):
        self.totals: dict[str, float] = {}
        self.means: dict[str, tuple[float, int]] = {}

    def add(self, stats: dict[str, float], responses: int) -> None:
        for key, v in stats.items():
            v = float(v)
            if kind(key) == "sum" or key.startswith("time/"):   # times add up over the calls
                self.totals[key] = self.totals.get(key, 0.0) + v
            elif not math.isnan(v):
                total, weight = self.means.get(key, (0.0, 0))
                self.means[key] = (total + v * responses, weight + responses)

    def result(self) -> dict[str, float]:
        return {**self.totals, **{k: t / max(w, 1) for k, (t, w) in self.means.items()}}


def combine(per_rank: list[dict[str, float]], dp: int) -> dict[str, float]:
    """One step's metrics from every rank's (`per_rank`): means over ranks, "max" keys their
    maximum, "sum" keys the sum over the `dp` data-parallel replicas (ranks of one replica hold the
    same values). NaN values are left out."""
    out = {}
    for k in sorted(set().union(*per_rank)):
        vals = [m[k] for m in per_rank if k in m and not math.isnan(m[k])]
        if not vals:
            continue
        how = kind(k)
        out[k] = (sum(vals) / len(vals) * dp if how == "sum" else max(vals) if how == "max"
                  else sum(vals) / len(vals))
    return out


def reduce_over_ranks(metrics: dict[str, float], dp: int) -> dict[str, float]:
    """`combine` of every rank's `metrics` (a collective over this role's world)."""
    from mrl.platform.collectives import gather_objects

    everyone = gather_objects(metrics, "metrics all-gather")
    return metrics if len(everyone) == 1 else combine(everyone, dp)


def reward_stats(calls: dict[int, list[tuple[dict[str, float], int]]]) -> dict[int, dict[str, float]]:
    """Each shard's reward statistics of one step (`RewardStats`) from its scoring calls, in order
    (`calls`: shard -> `(stats, responses scored)` of each call)."""
    out = {}
    for d, scored in calls.items():
        acc = RewardStats()
        for stats, responses in scored:
            acc.add(stats, responses)
        out[d] = acc.result()
    return out
