"""Liveness without collectives, separate placement: rollout ranks beat a heartbeat on the
rendezvous store (`Heartbeat`) and trainer rank 0 watches them (`Liveness`); trainer rank 0's
exchange threads (`Worker`).

Trainer rank 0 waits for a step's rollouts by polling the store (the rollout leader announces
each message it sends), and a rollout rank whose heartbeat stops for
`platform.collective_timeout_s` is an error naming it, whether it died or hangs. Weights are
broadcast only once every rollout rank says (on its heartbeat) that it waits for that version,
and rollout ranks wait for trainer rank 0's announcement by polling the store: neither side sits
in a collective for the length of a rollout or a training step.
"""
from __future__ import annotations

import queue as queue_mod
import threading
import time
from typing import Optional

import torch.distributed as dist

from mrl.errors import CollectiveTimeout


class Heartbeat:
    """A rollout rank's heartbeat: a counter on the rendezvous store, bumped every `every_s` by a
    daemon thread, with the number of messages this rank has sent (the rollout leader's tells the
    trainer one is ready to receive) and the weight version it waits for (-1: none)."""

    def __init__(self, store: dist.Store, rank: int, every_s: float = 0.5):
        self.store, self.rank, self.every_s = store, rank, every_s
        self.sent = 0
        self.ready_for = -1
        self._stop = threading.Event()
        self._beats = 0
        self._publish()
        self._thread = threading.Thread(target=self._run, name="mrl-rollout-heartbeat", daemon=True)
        self._thread.start()

    def _publish(self) -> None:
        self._beats += 1
        self.store.set(f"heartbeat/{self.rank}", f"{self._beats} {self.sent} {self.ready_for}")

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self._publish()
            except Exception:   # noqa: BLE001 - the store is gone: the job is ending
                return

    def announce(self, steps_sent: int) -> None:
        self.sent = steps_sent
        self._publish()

    def wait_for_weights(self, version: int) -> None:
        """Say this rank waits for weight version `version`, then wait until trainer rank 0
        announces that it broadcasts it (polling the store: a training step may take longer than
        any collective timeout, and a trainer that dies takes the launch down)."""
        self.ready_for = version
        self._publish()
        while not (self.store.check(["weights/announced"])
                   and int(self.store.get("weights/announced").decode()) >= version):
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()


class Liveness:
    """Trainer rank 0's view of the rollout ranks' heartbeats."""

    def __init__(self, store: dist.Store, ranks: list[int], timeout_s: float):
        self.store, self.ranks, self.timeout_s = store, ranks, timeout_s
        now = time.monotonic()
        self.last = {r: (None, now) for r in ranks}

    def _read(self, rank: int) -> tuple[int, int, int]:
        if not self.store.check([f"heartbeat/{rank}"]):
            return 0, 0, -1
        beats, sent, ready = self.store.get(f"heartbeat/{rank}").decode().split()
        return int(beats), int(sent), int(ready)

    def _wait(self, done, what: str) -> None:
        """Poll the heartbeats until `done(states)` ({rank: (sent, ready_for)}); a rollout rank
        whose heartbeat stood still for `timeout_s` raises `CollectiveTimeout` naming it."""
        while True:
            now = time.monotonic()
            states = {}
            for r in self.ranks:
                beats, sent, ready = self._read(r)
                states[r] = (sent, ready)
                seen, since = self.last[r]
                if beats != seen:
                    self.last[r] = (beats, now)
                elif now - since > self.timeout_s:
                    raise CollectiveTimeout(
                        f"stage '{what}': rollout rank {r} has given no sign of life for {now - since:.0f} s "
                        f"(platform.collective_timeout_s = {self.timeout_s:g}): it died or hangs; its log says where")
            if done(states):
                return
            time.sleep(0.02)

    def wait_until_sent(self, leader: int, messages: int, what: str) -> None:
        """Block until the rollout leader has sent `messages` messages."""
        self._wait(lambda states: states[leader][0] >= messages, what)

    def wait_until_ready(self, version: int, what: str) -> None:
        """Block until every rollout rank waits for weight version `version` (or a later one)."""
        self._wait(lambda states: all(ready >= version for _, ready in states.values()), what)


class Worker:
    """A daemon thread running `jobs` of one kind in order (trainer rank 0's rollout receiver and
    weight sender); an error is kept and raised in the main thread at its next call."""

    def __init__(self, name: str):
        self.jobs: "queue_mod.Queue" = queue_mod.Queue()
        self.error: Optional[BaseException] = None
        self.idle = threading.Event()
        self.idle.set()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, job) -> None:
        self.check()
        self.idle.clear()
        self.jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                if self.error is None:
                    job()
            except BaseException as e:   # noqa: BLE001 - re-raised in the main thread
                self.error = e
            if self.jobs.empty():
                self.idle.set()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        self.jobs.put(None)
