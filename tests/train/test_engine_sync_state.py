"""When the loop re-sends weights to the rollout engine (fakes; no model, no process group)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest


class FakeEngine:
    def __init__(self):
        self.loads, self.calls = 0, []

    def wake(self, tags=None):
        self.calls.append(("wake", tags))

    def sleep(self, level=None):
        self.calls.append(("sleep", level))

    def update_weights(self, stream, *, partial=False):
        self.loads += 1
        return len(list(stream))


def _parts():
    from mrl.train.parts import Generation, Learner

    exporter = SimpleNamespace(stream=lambda targets: iter([("w", 1)]))
    return Learner(actor=SimpleNamespace(steps=0), exporter=exporter), Generation(engine=FakeEngine())


@pytest.mark.parametrize("level,reloads", [(0, 1), (1, 1), (2, 2)])
def test_unchanged_weights_are_resent_only_after_a_level_2_sleep(level, reloads):
    from mrl.train.colocated import release_engine
    from mrl.train.engine_sync import sync_weights

    learner, gen = _parts()
    sync_weights(gen, learner, 0)   # e.g. validation before training
    release_engine(gen, level)
    sync_weights(gen, learner, 0)   # step 1: the actor has not changed
    assert gen.engine.loads == reloads
    learner.actor.steps += 1        # an update always reaches the engine
    sync_weights(gen, learner, 1)
    assert gen.engine.loads == reloads + 1 and gen.version == 1
    assert ("wake", ["weights"]) in gen.engine.calls
