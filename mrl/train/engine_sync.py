"""Publish, colocated: the actor's weights into the rollout engine that shares the trainer's ranks
(`rollout.placement = "colocated"`), a step's last stage (`mrl.train.source.RolloutSource.publish`).

`EngineWeights.publish(v)` loads version v into the engine (`sync_weights`, skipped when the
engine already holds it) and leaves the engine awake: evaluation of v and the next step's
generation use it. `mrl.train.colocated.ColocatedRollouts` is the source that takes the step's
rollouts (and then puts the engine to sleep for the training stages, `release_engine`) and
publishes with this.
"""
from __future__ import annotations

import time

from mrl.train.parts import Generation, Learner


def sync_weights(gen: Generation, learner: Learner, version: int) -> int:
    """Colocated: stream the actor's weights into the rollout engine (skipped when it already
    holds them) and record them as policy `version`; returns tensors sent (leader) or 0."""
    gen.version = version
    lost = gen.weights_key is None   # first sync, or the engine dropped its weights (sleep level 2)
    if gen.weights_key == learner.actor.steps:
        if gen.engine is not None:
            gen.engine.wake()
        return 0
    gen.weights_key = learner.actor.steps
    stream = learner.exporter.stream("all")
    if gen.engine is None:
        for _ in stream:   # every rank takes part in the gathers
            pass
        return 0
    gen.engine.wake(tags=["weights"])   # weights first: the KV cache is not needed to load them
    sent = gen.channel.push(stream, version, lost=lost) if gen.channel is not None else gen.engine.update_weights(stream)
    gen.engine.wake(tags=["kv_cache"])
    return sent


class EngineWeights:
    """The colocated source's `publish` (a base of `ColocatedRollouts`, whose `gen` and `learner`
    it reads); `sync_s` is the last publish's time, reported with the next step."""

    gen: Generation
    learner: Learner
    sync_s: float = 0.0

    def publish(self, version: int) -> None:
        started = time.perf_counter()
        sync_weights(self.gen, self.learner, version=version)
        self.sync_s = time.perf_counter() - started
