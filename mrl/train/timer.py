"""Wall-clock time per stage of a step, reported as `time/<stage>` and shares of the step.

Each timed stage is also a named `mrl.platform.dist.stage` (naming only, no watchdog of its own:
the collectives inside carry their own timeouts), so a collective that times out anywhere in a
step names the step stage it was in."""
from __future__ import annotations

import contextlib
import time


class StageTimer:
    def __init__(self, on_stage=None):
        self.seconds: dict[str, float] = {}
        self._on_stage = on_stage
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, name: str):
        from mrl.platform.dist import stage

        if self._on_stage is not None:
            self._on_stage(name)
        t0 = time.perf_counter()
        try:
            with stage(name, watchdog=False):
                yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        total = time.perf_counter() - self._start
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        out["time/step"] = total
        out["time/rollout_share"] = self.seconds.get("rollout", 0.0) / total if total > 0 else 0.0
        return out
