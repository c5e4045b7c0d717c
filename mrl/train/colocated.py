"""`ColocatedRollouts`: the rollout source when the engine shares the trainer's ranks
(`rollout.placement = "colocated"`, see `mrl.train.source`).

`take` produces the step's rollouts inline (`mrl.train.produce`, or `mrl.train.driver` with one
router over every engine group) and then puts the engine to sleep for the training stages
(`rollout.sleep_level`). `publish(v)`, the step's last stage, is `mrl.train.engine_sync`'s: it
loads version v into the engine and leaves it awake for the evaluation of v and the next step's
generation.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from mrl.platform.collectives import dp_min, gather_objects, world_max
from mrl.rollout.weight_channel import channel_metrics
from mrl.train.carry import encode_carry, merge_carries, restore_shards
from mrl.train.driver import driven_step, driver_routes
from mrl.train.engine_sync import EngineWeights
from mrl.train.parts import Generation, Learner, Prompts, Run, SampleLog
from mrl.train.produce import ShardRollout, produce
from mrl.train.evaluate import ValidationResult, evaluate, validation_steps


def release_engine(gen: Generation, sleep_level: int) -> None:
    """Put the colocated rollout engine to sleep for the training stages (`rollout.sleep_level`,
    0 = never). Level 2 discards the engine's weights: the next sync must send them again even
    when the actor has not changed (validation before training, critic warm-up steps)."""
    if gen.engine is not None and sleep_level > 0:
        gen.engine.sleep(sleep_level)
    if sleep_level >= 2:
        gen.weights_key = None


class ColocatedRollouts(EngineWeights):
    def __init__(self, run: Run, learner: Learner, gen: Generation, prompts: Prompts,
                 samples: Optional[SampleLog] = None):
        self.run, self.learner, self.gen, self.prompts = run, learner, gen, prompts
        self.samples = samples if samples is not None else SampleLog()
        self.validated: list[int] = []     # the versions this run validates
        self.sync_s = 0.0                  # the last publish's time (reported with the next step)
        self.driven = driver_routes(run.spec)   # one router on rank 0 over every leader's engine

    def start(self, start: int) -> None:
        self.validated = validation_steps(self.run.spec.trainer, self.run.total_steps, start)
        self.publish(start)

    def take(self, step: int, t) -> tuple[ShardRollout, dict[str, float]]:
        with t("rollout"):
            if self.driven:
                rollout = driven_step(self.run, self.gen, self.prompts, step, self.learner.reward_model)
            else:
                rollout = produce(self.run, self.gen, self.prompts, step, dp_min, reward_model=self.learner.reward_model)
        release_engine(self.gen, self.run.spec.rollout.sleep_level)
        return rollout.shards[self.run.ctx.dp_rank], {"time/weight_sync": self.sync_s,
                                                      "train/epoch": float(self.prompts.epoch),
                                                      **channel_metrics(self.gen.channel)}

    def validations(self, step: int, *, final: bool = False,
                    on_stage: Optional[Callable[[str], None]] = None) -> list[ValidationResult]:
        """Evaluate version `step` now when the run validates it (once)."""
        if step not in self.validated:
            return []
        self.validated.remove(step)
        if on_stage is not None:
            on_stage("validation")
        started = time.perf_counter()
        metrics = evaluate(self.run, self.gen, self.prompts, step, self.samples, self.learner.reward_model)
        metrics["time/validation"] = world_max(time.perf_counter() - started, "timing all-reduce")
        return [ValidationResult(step, metrics, self.samples.take("validation"))]

    # checkpoint state: the data position and the partial groups in hand; nothing else is in flight
    def state(self, step: int) -> dict:
        """Every shard's groups in hand and sampler position (each data-parallel rank holds its
        own; megatron saves rank 0's copy of this common state), gathered so every rank saves the
        same."""
        p = self.prompts
        mine = encode_carry({d: p.carry[d] for d in p.shards if d in p.carry},
                            {d: p.samplers[d].state_dict() for d in p.shards})
        everyone = gather_objects((p.position, mine), "checkpoint: every shard's groups in hand")
        return {"sampler": everyone[0][0], "rollout_carry": merge_carries([c for _, c in everyone])}

    def load_state(self, saved, start: int) -> str:
        return restore_shards(self.prompts, saved.sampler, saved.rollout_carry)

    def close(self, wait: bool = True) -> None:
        pass
