"""Wall-clock time per stage of a step, reported as `time/<stage>` and shares of the step, and on
CUDA the peak memory the caching allocator held during each stage (`memory/<stage>_peak_gib`).

Each timed stage is also a named `mrl.platform.dist.stage` (naming only, no watchdog of its own:
the collectives inside carry their own timeouts), so a collective that times out anywhere in a
step names the step stage it was in."""
from __future__ import annotations

import contextlib
import time


def _cuda():
    import torch

    return torch.cuda if torch.cuda.is_available() and torch.cuda.is_initialized() else None


class StageTimer:
    def __init__(self, on_stage=None):
        self.seconds: dict[str, float] = {}
        self.peak_bytes: dict[str, int] = {}
        self._on_stage = on_stage
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, name: str):
        from mrl.platform.dist import stage

        if self._on_stage is not None:
            self._on_stage(name)
        cuda = _cuda()
        if cuda is not None:
            cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            with stage(name, watchdog=False):
                yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
            if cuda is not None:
                self.peak_bytes[name] = max(self.peak_bytes.get(name, 0), cuda.max_memory_allocated())

    def metrics(self) -> dict[str, float]:
        total = time.perf_counter() - self._start
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        out.update({f"memory/{k}_peak_gib": v / 2**30 for k, v in self.peak_bytes.items()})
        out["time/step"] = total
        # the step's time spent on (colocated) or waiting for (separate) its rollouts
        rollout = self.seconds.get("rollout", 0.0) + self.seconds.get("rollout_wait", 0.0)
        out["time/rollout_share"] = rollout / total if total > 0 else 0.0
        return out
