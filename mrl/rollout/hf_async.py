"""The `hf` server-mode engine (`rollout.mode = "server"`, `rollout.engine = "hf"`): a continuously
batching scheduler over the transformers engine (`hf.HFEngine`), on the server's event loop.

Why: server mode's agent loop, router, over-sampling with abort and carried partial trajectories
then run wherever `transformers` runs (the embedded CPU default), and they run deterministically:
the scheduler is one coroutine on the `LoopThread` that computes in that thread, so which
requests share a batch, where an abort cuts a trajectory and which groups finish first depend
only on the requests (never on wall-clock time, as they do with vLLM's engine core in processes
of its own). A killed run resumed from its checkpoint therefore logs exactly what the
uninterrupted run logs (`tests/train/test_server_resume.py`) as long as the agent is
deterministic (single-turn, or tools whose results do not depend on timing).

Scheduling: requests wait in arrival order; each scheduler step admits waiting requests up to
`max_num_seqs` running (`rollout.max_num_seqs`) and up to `max_num_batched_tokens` tokens of new
prompts in that step (`rollout.max_num_batched_tokens`, as vLLM's scheduler budget; the first
waiting request is always admitted when nothing runs), advances every running request by up to `tick_tokens`
tokens in one batched `HFEngine.generate` call (the prompt plus the tokens so far is the call's
prompt; the call's seed is the request's seed and its step count, so a request samples the same
in whatever batch it runs), returns the requests that stopped or reached their `max_tokens`, and
yields to the loop once (clients react, aborts arrive) before its next step, as a server's
engine keeps stepping while its clients process results. The HF engine recomputes the prompt's
KV cache on every call, so `tick_tokens` trades admission latency against prefill work.

`abort` ends a request at its next scheduler step with the tokens it has (`finish_reason =
"abort"`); `pause` stops the scheduler between steps (a weight update then runs in the trainer's
thread while no step computes) and `resume` restarts it. Weights, read-back, sleep and wake are
the `HFEngine`'s.
"""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from mrl.rollout.async_engine import AsyncEngine, GenRequest, GenResult
from mrl.rollout.engine import WeightStream
from mrl.rollout.types import prompt_seed

#: tokens each running request advances per scheduler step (see the module docstring)
TICK_TOKENS = 8


@dataclass
class _Running:
    request: GenRequest
    future: asyncio.Future
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    steps: int = 0
    version: Optional[int] = None
    aborted: bool = False


class HFAsyncEngine(AsyncEngine):
    """`HFEngine` behind the server-mode interface (see the module docstring)."""

    def __init__(self, engine, *, tick_tokens: int = TICK_TOKENS, max_num_seqs: Optional[int] = None,
                 max_num_batched_tokens: Optional[int] = None):
        if tick_tokens < 1:
            raise ValueError("tick_tokens must be >= 1")
        self.engine, self.tick_tokens = engine, tick_tokens
        self.max_num_seqs = max_num_seqs or engine.max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[_Running] = deque()
        self.running: list[_Running] = []
        self.version = 0            # weight updates loaded so far
        self.steps = 0              # scheduler steps run (batched generate calls)
        self._paused = False
        self._wake: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None

    # --- requests ---------------------------------------------------------------------------------
    async def generate(self, request: GenRequest) -> GenResult:
        self._start()
        r = _Running(request, asyncio.get_running_loop().create_future())
        self.waiting.append(r)
        self._wake.set()
        try:
            return await r.future
        except asyncio.CancelledError:
            r.aborted = True    # its caller is gone: dropped at the next step
            raise

    async def abort(self, request_ids: Sequence[str]) -> None:
        wanted = set(request_ids)
        for r in list(self.waiting) + self.running:
            if r.request.request_id in wanted:
                r.aborted = True
        if self._wake is not None:
            self._wake.set()

    async def pause(self, *, abort_running: bool = False) -> None:
        self._paused = True   # runs on the loop, so no step is computing now
        if abort_running:
            await self.abort([r.request.request_id for r in list(self.waiting) + self.running])
            self._reap()

    async def resume(self) -> None:
        self._paused = False
        if self._wake is not None:
            self._wake.set()

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._schedule(), name="mrl-hf-scheduler")

    async def _schedule(self) -> None:
        while True:
            self._reap()
            if self._paused or not (self.waiting or self.running):
                self._wake.clear()
                await self._wake.wait()
                continue
            self._admit()
            try:
                self._step()
            except BaseException as e:   # the requests of the batch fail with it; the scheduler goes on
                for r in self.running:
                    if not r.future.done():
                        r.future.set_exception(e)
                self.running = []
            await asyncio.sleep(0)

    def _admit(self) -> None:
        """Waiting requests into the running batch, within `max_num_seqs` and this step's prompt budget."""
        spent = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            cost = len(r.request.prompt_ids) + len(r.token_ids)
            if self.max_num_batched_tokens is not None and self.running and spent + cost > self.max_num_batched_tokens:
                break
            spent += cost
            self.running.append(self.waiting.popleft())

    def _reap(self) -> None:
        """Return aborted requests (waiting or running) with what they have."""
        keep = deque()
        for r in self.waiting:
            self._finish(r, "abort") if r.aborted else keep.append(r)
        self.waiting = keep
        running = []
        for r in self.running:
            self._finish(r, "abort") if r.aborted else running.append(r)
        self.running = running

    def _finish(self, r: _Running, reason: str) -> None:
        if not r.future.done():
            r.future.set_result(GenResult(r.request.request_id, r.token_ids, r.logprobs, reason,
                                          self.version if r.version is None else r.version))

    def _step(self) -> None:
        """One batched call: every running request advances by up to `tick_tokens` tokens."""
        self.steps += 1
        batches: dict = {}
        for r in self.running:
            left = r.request.sampling.max_tokens - len(r.token_ids)
            sampling = replace(r.request.sampling, n=1, seed=None, max_tokens=min(self.tick_tokens, left))
            batches.setdefault(sampling, []).append(r)
        done = set()
        for sampling, rows in batches.items():
            seeds = [None if r.request.seed is None else prompt_seed(r.request.seed, r.steps) % 2**31 for r in rows]
            images = [r.request.images for r in rows]   # each row's prompt images (VLMs), with every tick
            extra = {"images": images} if any(x is not None for x in images) else {}
            out = self.engine.generate([list(r.request.prompt_ids) + r.token_ids for r in rows], sampling,
                                       prompt_seeds=None if None in seeds else seeds, **extra)
            for r, resp in zip(rows, out):
                if r.version is None:
                    r.version = self.version
                r.token_ids += list(resp.token_ids)
                r.logprobs += list(resp.logprobs)
                r.steps += 1
                if resp.finish_reason == "stop":
                    self._finish(r, "stop")
                    done.add(id(r))
                elif len(r.token_ids) >= r.request.sampling.max_tokens:
                    self._finish(r, "length")
                    done.add(id(r))
        self.running = [r for r in self.running if id(r) not in done]

    # --- weights and memory -----------------------------------------------------------------------
    def update_weights(self, weights: WeightStream, *, partial: bool = False) -> int:
        loaded = self.engine.update_weights(weights, partial=partial)
        self.version += 1
        return loaded

    @property
    def accepts_sparse(self) -> bool:
        return self.engine.accepts_sparse

    def apply_sparse(self, name, indices, values) -> None:
        self.engine.apply_sparse(name, indices, values)

    def load_unit(self, name: str) -> str:
        return self.engine.load_unit(name)

    def held_weights(self, names):
        return self.engine.held_weights(names)

    def sequence_logprobs(self, token_ids):
        return self.engine.sequence_logprobs(token_ids)

    def sleep(self, level: Optional[int] = None) -> None:
        self.engine.sleep(level)

    def wake(self, tags: Optional[Sequence[str]] = None) -> None:
        self.engine.wake(tags)

    def shutdown(self) -> None:
        if self._task is not None:
            loop = self._task.get_loop()
            if loop.is_running():
                loop.call_soon_threadsafe(self._task.cancel)
            self._task = None
        self.engine.shutdown()
