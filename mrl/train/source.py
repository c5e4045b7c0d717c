"""Where a trainer step's rollouts come from: the `RolloutSource` interface and its two
placements.

- `rollout.placement = "colocated"` (`mrl.train.colocated.ColocatedRollouts`): the engine shares
  the trainer's ranks; `take` produces the step's rollouts inline (`mrl.train.produce`).
- `"separate"` (`mrl.train.separate.SeparateRollouts`): the last `rollout.ranks` ranks run the
  producer (`mrl.train.serve`) and the trainer takes its rollouts from a bounded queue.

The loop (`mrl.train.loop`) calls the same six methods whatever the placement, and weights leave
the trainer in one place: `publish(v)` after the update that made version v (and `start`, for the
version a run starts from).

Policy versions and staleness. Version v is the actor after v training steps. With
`rollout.max_staleness = k`, step t trains on responses generated with version
`max(0, t - 1 - k)` exactly: k = 0 is on-policy, k = 1 overlaps the generation
of step t + 1 with the training of step t, k > 1 lets the producer run up to k steps ahead. The
choice is deterministic, so the lag of every response is exactly `min(k, t - 1)` and a resumed
run equals an uninterrupted one (`mrl.train.separate.needed_version`).
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol

from mrl.train.colocated import ColocatedRollouts
from mrl.train.evaluate import ValidationResult
from mrl.train.parts import Generation, Learner, Prompts, Run
from mrl.train.separate import SeparateRollouts


class RolloutSource(Protocol):
    def start(self, start: int) -> None:
        """Begin after step `start` (0: a fresh run) and publish version `start`."""

    def take(self, step: int, timer) -> tuple[object, dict[str, float]]:
        """This rank's `ShardRollout` of step `step` and the rollout metrics (with `train/epoch`,
        the data position's epoch after it); `timer` is the step's `StageTimer`."""

    def publish(self, version: int) -> None:
        """The actor now is policy `version`: hand its weights to the rollout engines that need
        them (colocated: load them into the engine; separate: send them to the rollout ranks)."""

    def validations(self, step: int, *, final: bool = False,
                    on_stage: Optional[Callable[[str], None]] = None) -> list[ValidationResult]:
        """The validations ready after step `step` (colocated: run now when the step validates;
        separate: those the rollout ranks sent). `final`: also wait for every one up to `step`."""

    def state(self, step: int) -> dict:
        """The data position after step `step` (and rollouts or groups in hand) for a checkpoint."""

    def load_state(self, saved: dict, start: int) -> str:
        """Restore `state` of a checkpoint taken after step `start`; says what it restored."""

    def close(self, wait: bool = True) -> None:
        """Stop; `wait=False` for a failing run (its error is the one to report)."""


def rollout_source(run: Run, learner: Learner, generation: Optional[Generation], prompts: Prompts,
                   samples) -> RolloutSource:
    """The source of `run`'s placement on a trainer rank."""
    if run.plan.separate:
        return SeparateRollouts(run, learner, prompts.dataset)
    return ColocatedRollouts(run, learner, generation, prompts, samples)
