"""A fake `AsyncEngine` for server-mode tests: answers by a script, one token per `tick` seconds."""
from __future__ import annotations

import asyncio

from mrl.rollout.async_engine import AsyncEngine, GenRequest, GenResult


class FakeAsyncEngine(AsyncEngine):
    """`answer(prompt_ids) -> token ids` decides each request's output; tokens come out one per
    `tick` seconds (log-prob -0.25 each), cut at `max_tokens` ("length"); `abort` stops a request
    at the token it reached. Records every request it served (`served`: (name, request))."""

    def __init__(self, answer, tick: float = 0.001, name: str = "engine"):
        self.answer, self.tick, self.name = answer, tick, name
        self.served: list[tuple[str, GenRequest]] = []
        self.stop: set[str] = set()
        self.paused = asyncio.Event()
        self.paused.set()
        self.weights = 0

    async def generate(self, request: GenRequest) -> GenResult:
        self.served.append((self.name, request))
        want = list(self.answer(list(request.prompt_ids)))
        ids = []
        for tok in want[:request.sampling.max_tokens]:
            await self.paused.wait()
            if request.request_id in self.stop:
                return GenResult(request.request_id, ids, [-0.25] * len(ids), "abort", self.weights)
            await asyncio.sleep(self.tick)
            ids.append(tok)
        reason = "length" if len(want) > request.sampling.max_tokens else "stop"
        return GenResult(request.request_id, ids, [-0.25] * len(ids), reason, self.weights)

    async def abort(self, request_ids):
        self.stop |= set(request_ids)

    async def pause(self, *, abort_running: bool = False):
        self.paused.clear()

    async def resume(self):
        self.paused.set()

    def update_weights(self, weights, *, partial=False):
        self.updated_while_paused = not self.paused.is_set()
        self.weights += 1
        return sum(1 for _ in weights)

    def sleep(self, level=None):
        pass

    def wake(self, tags=None):
        pass

    def shutdown(self):
        pass
