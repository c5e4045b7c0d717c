"""`SeparateRollouts`: the trainer side of `rollout.placement = "separate"` (see
`mrl.train.source`); the rollout ranks run `mrl.train.serve.serve`.

The exchange:
- start: trainer rank 0 sends the first step to produce and the data position. The producer
  samples prompts itself, with one sampler per trainer data-parallel shard, seeded as the
  trainer's own would be, so the prompts and seeds equal the colocated run's.
- weights (`publish`): trainer rank 0 broadcasts version v over the weights group
  (`mrl.train.wire`: versioned, checksummed buckets, full or delta, periodically verified),
  right after step v, when a later step needs it or the rollout side validates it (and version
  0, or the resumed version, at the start). A step reports the `weight_sync/*` figures of the
  version its rollouts were generated with, the first time one does.
- rollouts: the rollout ranks gather their shards on rollout rank 0, which sends the step's
  `StepRollout` to trainer rank 0; trainer rank 0 broadcasts it to the trainer's world when the
  step consumes it, and receives rollouts ahead of need (it waits only when the queue is empty).
  The queue holds at most k + 1 steps of rollouts.
- liveness: `mrl.train.liveness` (heartbeats on the store; no side waits in a collective for a
  rollout or a training step).
- checkpoints: after step s, trainer rank 0 drains the rollouts already determined (steps up to
  s + 1 + k, all generated from versions <= s) into its queue and saves them with the data
  position after them; a resume restores the queue, so no prompt is lost or trained twice and
  the resumed run generates exactly what the uninterrupted one would.
"""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Callable, Optional

from mrl.platform.bridge import Bridge
from mrl.platform.collectives import broadcast_object
from mrl.platform.dist import wait_for_peers
from mrl.train.codec import decode_rollout, encode_rollout
from mrl.train.liveness import Liveness, Worker
from mrl.train.parts import Learner, Run
from mrl.train.produce import ShardRollout, StepRollout
from mrl.train.evaluate import ValidationResult, validation_steps
from mrl.train.wire import BridgeSender


def needed_version(step: int, max_staleness: int, start_version: int = 0) -> int:
    """The policy version step `step`'s rollouts are generated with."""
    return max(start_version, step - 1 - max_staleness)


def versions_sent(first_step: int, last_step: int, max_staleness: int, start_version: int,
                  validated: list[int]) -> list[int]:
    """The policy versions trainer rank 0 sends to the rollout ranks, in order: each one a step
    from `first_step` to `last_step` is generated with, and each one validated (`validated`,
    which the rollout ranks validate as they receive them)."""
    needed = {needed_version(t, max_staleness, start_version) for t in range(first_step, last_step + 1)}
    return sorted(needed | {v for v in validated if v >= start_version})


@dataclass
class Start:
    first_step: int           # the first step the producer generates
    last_step: int
    start_version: int        # the policy version the trainer holds at the start
    position: Optional[dict]  # data position before first_step (None: from the start)
    validated: list           # the versions to validate (`mrl.train.evaluate.validation_steps`)
    carry: Optional[dict]     # partial rollouts in hand before first_step (encoded)




class SeparateRollouts:
    """Trainer side of the separate placement (see the module docstring).

    On trainer rank 0 two threads keep the exchange from ever blocking training: a receiver takes
    each step's rollouts as soon as the rollout leader announces them (so the producer is never
    held in a send), and a sender broadcasts each weight version to the rollout ranks while the
    trainer moves on. With `max_staleness` > 0 the sender works from a copy of the exported
    weights in host memory (the trainer's next update must not change what is being sent); with 0
    the producer is waiting for the weights, so they are streamed without a copy."""

    def __init__(self, run: Run, learner: Learner, dataset):
        self.run, self.learner, self.dataset = run, learner, dataset
        self.bridge: Bridge = run.ctx.bridge
        self.k = run.spec.rollout.max_staleness
        self.queue: collections.deque[StepRollout] = collections.deque()   # rank 0 only
        self.arrived = threading.Condition()
        self.received = 0                   # the newest step received from the producer (rank 0)
        self.first_step = 1
        self.start_version = 0
        self.position: Optional[dict] = None   # data position after the newest step taken
        self.carry: Optional[dict] = None      # partial rollouts in hand after the newest step taken
        self.receiver: Optional[Worker] = None
        self.sender: Optional[Worker] = None
        self.sender_liveness: Optional[Liveness] = None
        self.sent: list[int] = []            # versions to send (`versions_sent`)
        self.validated: list[int] = []       # versions the rollout side validates
        self.results: collections.deque[ValidationResult] = collections.deque()   # arrived, not yet logged
        self.results_seen = 0
        self.channel: Optional[BridgeSender] = None   # rank 0: what the rollout ranks hold
        self.synced: dict[int, dict[str, float]] = {}   # rank 0: version -> its sync's metrics
        self.synced_cv = threading.Condition()
        self.reported: set[int] = set()

    @property
    def is_root(self) -> bool:
        return self.bridge.rank == 0

    # -- the start, fresh or resumed
    def load_state(self, saved, start: int) -> str:
        """Restore the queue of a checkpoint taken after step `start` (`saved`: its
        `mrl.checkpoint.run_state.RunState`); says what it restored."""
        queued = [decode_rollout(q, self.dataset) for q in saved.rollout_queue]
        if self.is_root:
            self.queue.extend(queued)
        self.first_step = start + 1 + len(queued)
        self.start_version = start
        self.position = saved.sampler
        self.carry = saved.rollout_carry
        return f"{len(queued)} steps of rollouts restored, generation resumes at step {self.first_step}"

    def start(self, start: int) -> None:
        """Tell the producer where to start and send it the weights its first step needs."""
        self.start_version = start
        self.first_step = max(self.first_step, start + 1)
        self.received = self.first_step - 1
        total = self.run.total_steps
        self.validated = validation_steps(self.run.spec.trainer, total, start)
        self.sent = versions_sent(self.first_step, total, self.k, start, self.validated)
        if self.is_root:
            split = self.bridge.split
            ranks = [split.rollout_global(i) for i in range(split.rollout_ranks)]
            liveness = Liveness(self.bridge.store, ranks, self.run.spec.platform.collective_timeout_s)
            # the sender thread's own view (each thread tracks the beats it has seen)
            self.sender_liveness = Liveness(self.bridge.store, ranks, self.run.spec.platform.collective_timeout_s)
            self.channel = BridgeSender.from_config(self.bridge, ranks, self.run.spec.rollout)
            self.bridge.send_object(Start(self.first_step, total, self.start_version, self.position,
                                           self.validated, self.carry), self.bridge.rollout_leader, "rollout start")
            self.receiver = Worker("mrl-rollout-receiver")
            self.sender = Worker("mrl-weight-sender")
            messages = total - self.first_step + 1 + len(self.validated)
            for index in range(1, messages + 1):
                self.receiver.submit(lambda index=index: self._receive(liveness, index))
        wait_for_peers("rollout start")
        self.publish(start)

    def _receive(self, liveness: Liveness, index: int) -> None:
        """Receive the producer's `index`-th message: a step's rollouts or a validation."""
        what = f"rollouts of step {self.received + 1}"
        liveness.wait_until_sent(self.bridge.rollout_leader, index, what)
        got = self.bridge.recv_object(self.bridge.rollout_leader, what)
        with self.arrived:
            if isinstance(got, ValidationResult):
                self.results.append(got)
                self.results_seen += 1
            else:
                if got.step != self.received + 1:
                    raise RuntimeError(f"expected the rollouts of step {self.received + 1}, received step {got.step}")
                self.queue.append(got)
                self.received = got.step
            self.arrived.notify_all()

    def validations(self, step: int, *, final: bool = False,
                    on_stage: Optional[Callable[[str], None]] = None) -> list[ValidationResult]:
        """Trainer rank 0: the validations that arrived (and not yet taken); with `final`, first
        wait for every one of a version <= `step` (the end of the run: every version)."""
        if not self.is_root:
            return []
        want = len([v for v in self.validated if final and v <= step])
        with self.arrived:
            while self.results_seen < want:
                self.receiver.check()
                self.arrived.wait(timeout=0.1)
            out = list(self.results)
            self.results.clear()
        return out

    def _wait_received(self, step: int) -> None:
        """Rank 0: block until the receiver holds step `step` (or raise its error)."""
        with self.arrived:
            while self.received < step:
                self.receiver.check()
                self.arrived.wait(timeout=0.1)
        self.receiver.check()

    def _send_weights(self, version: int) -> None:
        if not self.is_root:
            for _ in self.learner.exporter.stream(0):   # the gathers need every trainer rank
                pass
            return
        if self.k == 0:   # the producer waits for these weights: stream them, no copy
            self.sender.idle.wait()
            self.sender.check()
            self._sync(self.learner.exporter.stream(0), version)
            return
        staged = [(name, t.detach().to("cpu", copy=True)) for name, t in self.learner.exporter.stream(0)]
        self.sender.submit(lambda: self._sync(iter(staged), version))

    def _sync(self, stream, version: int) -> None:
        """Rank 0 (the sender thread when k > 0): send `version`, keep what it moved for `take`."""
        stats = self.channel.send(stream, version, self.sender_liveness)
        with self.synced_cv:   # time/weight_sync: from the rollout ranks being ready to the last frame sent
            self.synced[version] = {**stats.metrics(), "time/weight_sync": self.channel.seconds}
            self.synced_cv.notify_all()

    def _sync_metrics(self, step: int) -> dict[str, float]:
        """Rank 0: the `weight_sync/*` figures of the version step `step` was generated with, the
        first time a step reports it (none for a version a resumed run did not send itself)."""
        version = needed_version(step, self.k, self.start_version)
        if version in self.reported or version not in self.sent:
            return {}
        self.reported.add(version)
        with self.synced_cv:   # its rollouts arrived, so the sync is done; its stats follow at once
            while version not in self.synced:
                self.sender.check()
                self.synced_cv.wait(timeout=0.1)
            return self.synced.pop(version)

    def take(self, step: int, t) -> tuple[ShardRollout, dict[str, float]]:
        with t("rollout_wait"):
            got = None
            synced: dict[str, float] = {}
            if self.is_root:
                self.sender.check()
                self._wait_received(step)
                with self.arrived:
                    while self.queue[0].step < step:
                        self.queue.popleft()
                    got = self.queue.popleft()
                synced = self._sync_metrics(step)
            wait_for_peers("rollout wait")
            got: StepRollout = broadcast_object(got, "rollouts to trainer ranks")
        self.position, self.carry = got.position, got.carry
        # when the rollout side generated these (wall clock, for overlap timelines)
        return got.shards[self.run.ctx.dp_rank], {"time/rollout_generate": got.produce_s,
                                                  "time/rollout_generate_started_at": got.finished_at - got.produce_s,
                                                  "time/rollout_generate_ended_at": got.finished_at,
                                                  "train/epoch": float(self.position["epoch"]), **synced}

    def publish(self, version: int) -> None:
        """Send version `version` when a later step is generated from it or the rollout side
        validates it."""
        if version in self.sent:
            self._send_weights(version)

    def state(self, step: int) -> dict:
        """After step `step`: drain the rollouts already determined into the queue (rank 0) and
        return them with the data position after them, for the checkpoint."""
        last = min(step + 1 + self.k, self.run.total_steps)
        queued = []
        if self.is_root:
            self._wait_received(last)
            with self.arrived:
                queued = [q for q in self.queue if q.step > step]
        wait_for_peers("rollout queue drain")
        # every rank stores the same extra (megatron's checkpoint checks that its common state agrees)
        position, carry, encoded = broadcast_object(
            (queued[-1].position if queued else self.position, queued[-1].carry if queued else self.carry,
             [encode_rollout(q) for q in queued]), "checkpoint save")
        return {"sampler": position, "rollout_carry": carry, "rollout_queue": encoded}

    def close(self, wait: bool = True) -> None:
        """Stop the exchange threads; with `wait` (a run that finished), first let the weight
        sender finish (the producer takes every version it needs). A failing run does not wait:
        its threads are daemons and the error that stopped it is the one to report."""
        if self.sender is not None:
            if wait:
                self.sender.idle.wait()
                self.sender.check()
            self.sender.stop()
        if self.receiver is not None:
            self.receiver.stop()
