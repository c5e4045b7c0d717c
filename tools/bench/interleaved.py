"""Side-by-side timing for the benches: every round runs each variant once, so a change of load on
the machine hits all variants alike and their ratio stays meaningful (`rope.py`, `delta_rule.py`)."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def interleaved_medians(fns: dict[str, Callable[[], object]], iters: int, warmup: int,
                        sync: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Median seconds of each `fns[name]()` over `iters` interleaved rounds after `warmup` rounds;
    `sync` (e.g. `torch.cuda.synchronize`) runs after each call so asynchronous work is timed."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}
