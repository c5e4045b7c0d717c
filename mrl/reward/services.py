"""The scorers of `url` (reward service) and `judge` sources, built from the `reward` section.

Unlike rule sources they do not run in the worker pool: a service call is I/O (threads wait on
HTTP), and a local judge model is loaded once in the scoring process, on a rollout engine of its
own (`mrl.reward.judge.EngineJudge`). Each scorer takes the
batch's `RewardSample`s and returns one `mrl.reward.pool.Outcome` per sample, which the
`Rewarder` reads, counts and weighs exactly like a reward function's outcomes.
"""
from __future__ import annotations

from typing import Callable, Sequence

from mrl.reward.config import RewardConfig
from mrl.reward.sources import RewardSource

SERVICE_KINDS = ("remote", "judge")


def service_scorers(cfg: RewardConfig, sources: Sequence[RewardSource], *, device="cpu",
                    seed: int = 0) -> dict[str, Callable]:
    """Source name -> scorer for every remote and judge source (the judge is built once; a local
    judge's engine on `device`, sampling from `seed`)."""
    from mrl.reward.judge import JudgeScorer
    from mrl.reward.remote import RemoteScorer

    out: dict[str, Callable] = {}
    judge = None
    for src in sources:
        if src.kind == "remote":
            out[src.name] = RemoteScorer.from_config(src.ref, cfg.remote)
        elif src.kind == "judge":
            judge = judge or JudgeScorer(cfg.judge, cfg.remote, device=device, seed=seed)
            out[src.name] = judge
    return out


def services_budget_s(cfg: RewardConfig, sources: Sequence[RewardSource], responses: int) -> float:
    """The longest the service sources of `sources` take for `responses` responses (no scorer built)."""
    from mrl.reward.remote import RemoteScorer

    total = 0.0
    r = cfg.remote
    for src in sources:
        if src.kind == "remote":
            total += RemoteScorer.from_config(src.ref, r).budget_s(responses)
        elif src.kind == "judge" and cfg.judge is not None and cfg.judge.url:   # one request per response
            total += RemoteScorer(src.ref, batch_size=1, concurrency=r.concurrency, timeout_s=r.timeout_s,
                                  retries=r.retries, backoff_s=r.backoff_s).budget_s(responses)
    return total
