"""The router of server-mode rollouts: which engine serves each request of a trajectory.

A trajectory's first request goes to the engine with the least outstanding work (the tokens
its in-flight requests may still generate: the sum of their `max_tokens`), ties to the lowest
index; every later request of the same trajectory goes to the same engine (sticky), so the
engine's prefix cache holds the conversation's earlier turns. `release` forgets a finished
trajectory.

The router also counts what the step reports: requests in flight per engine and the time each
engine had at least one (`busy_fraction`, the `rollout/engine_busy` metric: the share of the
wall time a request was in the engine, generating or queued there, not waiting for a tool).
Aborting a trajectory (`abort`) aborts its in-flight request and makes its later requests return
at once with `finish_reason = "abort"` and no tokens.

An engine is anything with `generate(GenRequest)` and `abort(ids)`: a local `AsyncEngine`, or a
`remote.RemoteEngine` (another leader's engine over its channel, `rollout.router = "driver"`);
`add` appends one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from mrl.rollout.async_engine import AsyncEngine, GenRequest, GenResult


@dataclass
class _Load:
    outstanding: int = 0          # max_tokens of the requests in flight
    in_flight: int = 0
    busy_s: float = 0.0
    busy_since: float = 0.0
    requests: dict[str, str] = field(default_factory=dict)   # request id -> trajectory id, in flight


class Router:
    """Least outstanding work, sticky per trajectory, over `engines` (one per engine group)."""

    def __init__(self, engines: Sequence[AsyncEngine]):
        if not engines:
            raise ValueError("a router needs at least one engine")
        self.engines = list(engines)
        self.loads = [_Load() for _ in self.engines]
        self.sticky: dict[str, int] = {}
        self.aborted: set[str] = set()
        self.started = time.monotonic()

    def add(self, engine) -> int:
        """Route over `engine` too; its index."""
        self.engines.append(engine)
        self.loads.append(_Load())
        return len(self.engines) - 1

    def pick(self, trajectory: str) -> int:
        """The engine of `trajectory`: its earlier one, else the least loaded now."""
        if trajectory not in self.sticky:
            self.sticky[trajectory] = min(range(len(self.engines)), key=lambda i: (self.loads[i].outstanding, i))
        return self.sticky[trajectory]

    async def generate(self, trajectory: str, request: GenRequest) -> GenResult:
        if trajectory in self.aborted:
            return GenResult(request.request_id, [], [], "abort")
        i = self.pick(trajectory)
        load = self.loads[i]
        if load.in_flight == 0:
            load.busy_since = time.monotonic()
        load.in_flight += 1
        load.outstanding += request.sampling.max_tokens
        load.requests[request.request_id] = trajectory
        try:
            return await self.engines[i].generate(request)
        finally:
            load.requests.pop(request.request_id, None)
            load.outstanding -= request.sampling.max_tokens
            load.in_flight -= 1
            if load.in_flight == 0:
                load.busy_s += time.monotonic() - load.busy_since

    async def abort(self, trajectories: Sequence[str]) -> None:
        """Abort these trajectories: their running requests now, their later ones on arrival."""
        wanted = set(trajectories)
        self.aborted |= wanted
        for engine, load in zip(self.engines, self.loads):
            ids = [r for r, t in load.requests.items() if t in wanted]
            if ids:
                await engine.abort(ids)

    def release(self, trajectory: str) -> None:
        self.sticky.pop(trajectory, None)
        self.aborted.discard(trajectory)

    def reset_clock(self) -> None:
        """Start a new busy-time window (one rollout call)."""
        now = time.monotonic()
        self.started = now
        for load in self.loads:
            load.busy_s = 0.0
            load.busy_since = now

    def busy_fraction(self) -> float:
        """Mean over engines of the share of the window with a request in the engine."""
        now = time.monotonic()
        wall = max(now - self.started, 1e-9)
        busy = [load.busy_s + (now - load.busy_since if load.in_flight else 0.0) for load in self.loads]
        return sum(min(b / wall, 1.0) for b in busy) / len(busy)
