"""Where a trainer step's rollouts come from: the producer and consumer stages of the RL loop.

Colocated (`rollout.placement = "colocated"`, `ColocatedRollouts`): the stages run in sequence
on every rank. Each step syncs the actor's weights into the engine, produces the step's rollouts
(`mrl.train.rollout.produce`) and puts the engine to sleep for training.

Separate (`"separate"`): the last `rollout.ranks` ranks run `serve` (the producer) and the
trainer ranks take rollouts from a bounded queue (`SeparateRollouts`, the consumer), connected by
the bridge of `mrl.platform.bridge`.

Policy versions and staleness. Version v is the actor after v training steps. With
`rollout.max_staleness = k`, step t trains on responses generated with version
`max(0, t - 1 - k)` exactly:
- k = 0 is on-policy: the producer waits for the weights of step t - 1 before generating step t.
- k = 1 is one-step off-policy: generation of step t + 1 overlaps the training of step t.
- k > 1 lets the producer run up to k steps ahead.
The choice is deterministic, so a run is reproducible, the lag of every response is exactly
`min(k, t - 1)`, and a resumed run equals an uninterrupted one. The queue holds at most k + 1
steps of rollouts.

The exchange, separate placement:
- start: trainer rank 0 sends the first step to produce and the data position. The producer
  samples prompts itself, with one sampler per trainer data-parallel shard, seeded as the
  trainer's own would be, so the prompts and seeds equal the colocated run's.
- weights: trainer rank 0 broadcasts version v over the weights group, bucketed, right after
  step v, when a later step needs it (and version 0, or the resumed version, at the start). A
  broadcast carries a header (names, shapes, dtypes, version) and then one flat buffer per bucket.
- rollouts: the rollout ranks gather their shards on rollout rank 0, which sends the step's
  `StepRollout` to trainer rank 0; trainer rank 0 broadcasts it to the trainer's world when the
  step consumes it. Trainer rank 0 receives rollouts ahead of need (it waits only when the queue
  is empty).
- liveness: every rollout rank beats a heartbeat on the rendezvous store; trainer rank 0 waits
  for a step's rollouts by polling the store (the rollout leader announces each message it
  sends), and a rollout rank whose heartbeat stops for `platform.collective_timeout_s` is an
  error naming it, whether it died or hangs. Weights are broadcast only once every rollout rank
  says (on its heartbeat) that it waits for that version, and rollout ranks wait for trainer rank
  0's announcement by polling the store: neither side sits in a collective for the length of a
  rollout or a training step.
- checkpoints: after step s, trainer rank 0 drains the rollouts already determined (steps up to
  s + 1 + k, all generated from versions <= s) into its queue and saves them with the data
  position after them; a resume restores the queue, so no prompt is lost or trained twice and
  the resumed run generates exactly what the uninterrupted one would.
"""
from __future__ import annotations

import collections
import json
import pickle
import queue as queue_mod
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from mrl.errors import CollectiveTimeout
from mrl.platform.bridge import Bridge
from mrl.rollout.types import Response
from mrl.rollout.weight_channel import channel_metrics
from mrl.train.parts import Generation, Learner, Prompts, Run
from mrl.train.rollout import ShardRollout, StepRollout, dp_min, produce, release_engine, sync_weights


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
class ValidationResult:
    """The rollout side's validation of one policy version: `val/*` metrics and sample rows."""

    version: int
    metrics: dict[str, float]
    rows: Optional[dict]


# ---------------------------------------------------------------------------- colocated

class ColocatedRollouts:
    """The rollout stages run inline on every rank (see the module docstring)."""

    def __init__(self, run: Run, learner: Learner, gen: Generation, prompts: Prompts):
        self.run, self.learner, self.gen, self.prompts = run, learner, gen, prompts

    def take(self, step: int, t) -> tuple[ShardRollout, dict[str, float]]:
        with t("weight_sync"):
            sync_weights(self.gen, self.learner, version=step - 1)
        with t("rollout"):
            rollout = produce(self.run, self.gen, self.prompts, step, dp_min, reward_model=self.learner.reward_model)
        return rollout.shards[self.run.ctx.dp_rank], channel_metrics(self.gen.channel)

    def greedy_baseline(self, batch, step: int) -> torch.Tensor:
        """ReMax: the score of one greedy response per prompt, per response `[B]`."""
        from dataclasses import replace

        from mrl.rollout.types import sampling_from_config
        from mrl.train.rollout import generate, score

        n = self.run.spec.rollout.responses_per_prompt
        items = batch.meta["prompt_item"][::n]
        greedy = replace(sampling_from_config(self.run.spec.rollout), n=1, temperature=0.0)
        responses = generate(self.run, self.gen, [list(it.token_ids) for it in items], greedy)
        scores = score(self.run, self.gen, items, responses, 1, step, reward_model=self.learner.reward_model)["scores"]
        return torch.tensor(scores, dtype=torch.float32).repeat_interleave(n)

    def release(self) -> None:
        release_engine(self.gen, self.run.spec.rollout.sleep_level)

    def sync_for_validation(self, step: int) -> None:
        sync_weights(self.gen, self.learner, version=step)

    # checkpoint state: the data position; nothing is in flight between steps
    def state(self, step: int) -> dict:
        from mrl.train.partial import encode_carry

        return {"sampler": self.prompts.position, "rollout_carry": encode_carry(self.prompts.carry)}

    def load_state(self, extra: dict, start: int) -> str:
        from mrl.train.partial import decode_carry

        self.prompts.load_position(extra["sampler"])
        self.prompts.carry = decode_carry(extra.get("rollout_carry"), self.prompts.dataset)
        return ""

    def validations(self, upto: Optional[int] = None) -> list:
        return []   # colocated validation runs inline in the loop

    def epoch(self) -> int:
        """The epoch of the data position after the step just trained."""
        return self.prompts.epoch

    def start(self, start: int) -> None:
        pass

    def after_update(self, step: int) -> None:
        pass

    def close(self, wait: bool = True) -> None:
        pass


# ---------------------------------------------------------------------------- the weight stream over the bridge

def send_weights(bridge: Bridge, stream, version: int, bucket_mb: int, liveness: "Liveness") -> int:
    """Trainer rank 0: once every rollout rank waits for it, announce and broadcast version
    `version` of the actor, the HF-named full tensors of `stream`, to the rollout ranks in buckets
    of `bucket_mb`; returns the tensors sent. (Both sides enter the broadcast only when the other
    is there, so no collective timeout covers a rollout or a training step.)"""
    from mrl.weights.hf_export import hf_buckets

    liveness.wait_until_ready(version, f"weight sync of version {version}")
    bridge.store.set("weights/announced", str(version))
    sent = 0
    for bucket in hf_buckets(stream, bucket_mb * 2**20):
        _broadcast_bucket(bridge, bucket, version)
        sent += len(bucket)
    _broadcast_bucket(bridge, [], version)   # end of this version
    return sent


def _broadcast_bucket(bridge: Bridge, bucket: list[tuple[str, torch.Tensor]], version: int) -> None:
    header = pickle.dumps((version, [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in bucket]))
    bridge.broadcast(torch.tensor([len(header)], dtype=torch.int64), "weight sync header size")
    bridge.broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8), "weight sync header")
    if bucket:
        flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket])
        bridge.broadcast(flat, f"weight sync bucket of {len(bucket)} tensors")


def receive_weights(bridge: Bridge):
    """Rollout side: (version, stream of (hf name, tensor)) of the next version trainer rank 0
    broadcasts; the stream must be consumed in full."""
    first = _receive_bucket(bridge)
    version = first[0]

    def stream():
        bucket = first
        while bucket[1]:
            yield from bucket[1]
            bucket = _receive_bucket(bridge)

    return version, stream()


def _receive_bucket(bridge: Bridge) -> tuple[int, list[tuple[str, torch.Tensor]]]:
    size = bridge.broadcast(torch.zeros(1, dtype=torch.int64), "weight sync header size")
    header = bridge.broadcast(torch.empty(int(size.item()), dtype=torch.uint8), "weight sync header")
    version, meta = pickle.loads(header.cpu().numpy().tobytes())
    if not meta:
        return version, []
    dtypes = [getattr(torch, d) for _, _, d in meta]
    sizes = [int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
             for (_, shape, _), dt in zip(meta, dtypes)]
    flat = bridge.broadcast(torch.empty(sum(sizes), dtype=torch.uint8), f"weight sync bucket of {len(meta)} tensors")
    out, at = [], 0
    for (name, shape, _), dt, nbytes in zip(meta, dtypes, sizes):
        out.append((name, flat[at:at + nbytes].view(dt).reshape(shape)))
        at += nbytes
    return version, out


# ---------------------------------------------------------------------------- liveness on the store

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


# ---------------------------------------------------------------------------- separate: the consumer

@dataclass
class _Start:
    first_step: int           # the first step the producer generates
    last_step: int
    start_version: int        # the policy version the trainer holds at the start
    position: Optional[dict]  # data position before first_step (None: from the start)
    validated: list           # the versions to validate (`mrl.train.validate.validation_steps`)
    carry: Optional[dict]     # partial rollouts in hand before first_step (encoded)


class _Worker:
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
        self.receiver: Optional[_Worker] = None
        self.sender: Optional[_Worker] = None
        self.sender_liveness: Optional[Liveness] = None
        self.sent: list[int] = []            # versions to send (`versions_sent`)
        self.validated: list[int] = []       # versions the rollout side validates
        self.results: collections.deque[ValidationResult] = collections.deque()   # arrived, not yet logged
        self.results_seen = 0

    @property
    def is_root(self) -> bool:
        return self.bridge.rank == 0

    # -- the start, fresh or resumed
    def load_state(self, extra: dict, start: int) -> str:
        """Restore the queue of a checkpoint taken after step `start`; says what it restored."""
        queued = [decode_rollout(q, self.dataset) for q in extra.get("rollout_queue", [])]
        if self.is_root:
            self.queue.extend(queued)
        self.first_step = start + 1 + len(queued)
        self.start_version = start
        self.position = extra["sampler"]
        self.carry = extra.get("rollout_carry")
        return f"{len(queued)} steps of rollouts restored, generation resumes at step {self.first_step}"

    def start(self, start: int) -> None:
        """Tell the producer where to start and send it the weights its first step needs."""
        from mrl.platform.dist import wait_for_peers

        from mrl.train.validate import validation_steps

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
            self.bridge.send_object(_Start(self.first_step, total, self.start_version, self.position,
                                           self.validated, self.carry), self.bridge.rollout_leader, "rollout start")
            self.receiver = _Worker("mrl-rollout-receiver")
            self.sender = _Worker("mrl-weight-sender")
            messages = total - self.first_step + 1 + len(self.validated)
            for index in range(1, messages + 1):
                self.receiver.submit(lambda index=index: self._receive(liveness, index))
        wait_for_peers("rollout start")
        if start in self.sent:
            self._send_weights(start)

    def _receive(self, liveness: "Liveness", index: int) -> None:
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

    def validations(self, upto: Optional[int] = None) -> list[ValidationResult]:
        """Trainer rank 0: the validations that arrived (and not yet taken); with `upto`, first
        wait for every one of a version <= `upto` (the end of the run: every version)."""
        if not self.is_root:
            return []
        want = len([v for v in self.validated if upto is not None and v <= upto])
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
        bucket_mb = self.run.spec.rollout.weight_sync.bucket_mb
        if not self.is_root:
            for _ in self.learner.exporter.stream(0):   # the gathers need every trainer rank
                pass
            return
        if self.k == 0:   # the producer waits for these weights: stream them, no copy
            self.sender.idle.wait()
            self.sender.check()
            send_weights(self.bridge, self.learner.exporter.stream(0), version, bucket_mb, self.sender_liveness)
            return
        staged = [(name, t.detach().to("cpu", copy=True)) for name, t in self.learner.exporter.stream(0)]
        self.sender.submit(lambda: send_weights(self.bridge, iter(staged), version, bucket_mb, self.sender_liveness))

    def take(self, step: int, t) -> tuple[ShardRollout, dict[str, float]]:
        from mrl.platform.dist import stage, wait_for_peers

        with t("rollout_wait"):
            box = [None]
            if self.is_root:
                self.sender.check()
                self._wait_received(step)
                with self.arrived:
                    while self.queue[0].step < step:
                        self.queue.popleft()
                    box = [self.queue.popleft()]
            wait_for_peers("rollout wait")
            if dist.get_world_size() > 1:
                with stage("rollouts to trainer ranks"):
                    dist.broadcast_object_list(box, src=0)
            got: StepRollout = box[0]
        self.position, self.carry = got.position, got.carry
        # when the rollout side generated these (wall clock, for overlap timelines)
        return got.shards[self.run.ctx.dp_rank], {"time/rollout_generate": got.produce_s,
                                                  "time/rollout_generate_started_at": got.finished_at - got.produce_s,
                                                  "time/rollout_generate_ended_at": got.finished_at}

    def epoch(self) -> int:
        """The epoch of the data position after the step just taken (the producer's)."""
        return int(self.position["epoch"])

    def greedy_baseline(self, batch, step: int):
        raise RuntimeError("remax needs a colocated rollout")   # refused by mrl validate

    def release(self) -> None:
        pass

    def sync_for_validation(self, step: int) -> None:
        raise RuntimeError("validation needs a colocated rollout")   # refused by mrl validate

    def after_update(self, step: int) -> None:
        """After step `step`'s update: send version `step` when a later step is generated from it
        or the rollout side validates it."""
        if step in self.sent:
            self._send_weights(step)

    def state(self, step: int) -> dict:
        """After step `step`: drain the rollouts already determined into the queue (rank 0) and
        return them with the data position after them, for the checkpoint."""
        from mrl.platform.dist import stage, wait_for_peers

        last = min(step + 1 + self.k, self.run.total_steps)
        queued = []
        if self.is_root:
            self._wait_received(last)
            with self.arrived:
                queued = [q for q in self.queue if q.step > step]
        wait_for_peers("rollout queue drain")
        # every rank stores the same extra (megatron's checkpoint checks that its common state agrees)
        box = [(queued[-1].position if queued else self.position, queued[-1].carry if queued else self.carry,
                [encode_rollout(q) for q in queued])]
        if dist.get_world_size() > 1:
            with stage("checkpoint save"):
                dist.broadcast_object_list(box, src=0)
        position, carry, encoded = box[0]
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


# ---------------------------------------------------------------------------- queued rollouts in checkpoints

def encode_rollout(r: StepRollout) -> dict:
    """A step's rollouts as plain values and tensors (checkpoints are read with
    `weights_only=True`: nothing in them may run code). Prompts are stored by dataset index."""
    shards = {}
    for d, s in r.shards.items():
        shards[str(d)] = {
            "items": [it.index for it in s.items],
            "lengths": torch.tensor([len(x.token_ids) for x in s.responses], dtype=torch.int64),
            "token_ids": torch.tensor([t for x in s.responses for t in x.token_ids], dtype=torch.int64),
            "logprobs": torch.tensor([v for x in s.responses for v in x.logprobs], dtype=torch.float32),
            "loss_mask": torch.tensor([v for x in s.responses for v in x.loss_mask], dtype=torch.int8),
            "finish": [x.finish_reason for x in s.responses],
            "info": [json.dumps(x.info) for x in s.responses],
            "prompt_index": [x.prompt_index for x in s.responses],
            "policy_version": [x.policy_version for x in s.responses],
            "scores": list(map(float, s.scores)),
            "stats": {k: float(v) for k, v in s.stats.items()},
            "version": s.version,
        }
    return {"step": r.step, "version": r.version, "position": dict(r.position), "produce_s": r.produce_s,
            "finished_at": r.finished_at, "shards": shards, "carry": r.carry}


def decode_rollout(e: dict, dataset) -> StepRollout:
    """The inverse of `encode_rollout`, over the same dataset."""
    shards = {}
    for d, s in e["shards"].items():
        lengths = s["lengths"].tolist()
        ends = torch.tensor(lengths).cumsum(0).tolist()
        tok, lp, lm = s["token_ids"].tolist(), s["logprobs"].tolist(), s["loss_mask"].tolist()
        responses = [Response(prompt_index=pi, token_ids=tok[end - n:end], logprobs=lp[end - n:end], finish_reason=f,
                              loss_mask=lm[end - n:end], info=json.loads(info), policy_version=v)
                     for n, end, f, info, pi, v in zip(lengths, ends, s["finish"], s["info"], s["prompt_index"],
                                                       s["policy_version"])]
        shards[int(d)] = ShardRollout(dp_rank=int(d), items=[dataset[i] for i in s["items"]], responses=responses,
                                      scores=list(s["scores"]), stats=dict(s["stats"]), version=int(s["version"]))
    return StepRollout(step=int(e["step"]), version=int(e["version"]), shards=shards, position=dict(e["position"]),
                       produce_s=float(e["produce_s"]), finished_at=float(e["finished_at"]), carry=e.get("carry"))


# ---------------------------------------------------------------------------- separate: the producer

def serve(run: Run, gen: Generation, prompts: Prompts) -> None:
    """The rollout ranks' loop (separate placement): take the start, then for each step take the
    weights it needs, produce its rollouts and send them to trainer rank 0."""
    bridge: Bridge = run.ctx.bridge
    heartbeat = Heartbeat(bridge.store, bridge.rank)
    try:
        start: _Start = None
        box = [None]
        if bridge.rank == bridge.rollout_leader:
            box = [bridge.recv_object(0, "rollout start")]
        from mrl.platform.dist import wait_for_peers

        wait_for_peers("rollout start")
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        start = box[0]
        if start.position is not None:
            prompts.load_position(start.position)
        if start.carry:
            from mrl.train.partial import decode_carry

            prompts.carry = decode_carry(start.carry, prompts.dataset)
        k = run.spec.rollout.max_staleness
        pending = versions_sent(start.first_step, start.last_step, k, start.start_version, start.validated)
        sent = 0
        leader = bridge.rank == bridge.rollout_leader

        def send(message, what: str) -> None:
            nonlocal sent
            if leader:
                sent += 1
                heartbeat.announce(sent)
                bridge.send_object(message, 0, what)

        def take_version() -> None:
            """Load the next version trainer rank 0 sends, and validate it when asked to."""
            heartbeat.wait_for_weights(pending[0])
            version, stream = receive_weights(bridge)
            if version != pending[0]:
                raise RuntimeError(f"expected policy version {pending[0]} from the trainer, received {version}")
            pending.pop(0)
            if gen.engine is not None:
                gen.engine.update_weights(stream)
            else:
                for _ in stream:
                    pass
            gen.version = version
            if version in start.validated:
                send(_validate(run, gen, prompts, version), f"validation of step {version}")

        for step in range(start.first_step, start.last_step + 1):
            need = needed_version(step, k, start.start_version)
            while pending and pending[0] <= need:
                take_version()
            rollout = produce(run, gen, prompts, step, _rollout_min)
            everyone = [None] * dist.get_world_size()
            from mrl.platform.dist import stage

            with stage("rollout shards to the rollout leader"):
                dist.all_gather_object(everyone, rollout.shards if gen.is_leader else {})
            rollout.shards = {d: s for part in everyone for d, s in part.items()}
            send(rollout, f"rollouts of step {step}")
        while pending:   # versions sent only to be validated (the last steps')
            take_version()
    finally:
        heartbeat.stop()


def _validate(run: Run, gen: Generation, prompts: Prompts, version: int) -> ValidationResult:
    """Validate the policy the rollout ranks hold (version `version`)."""
    from mrl.train.parts import SampleLog
    from mrl.train.validate import validate

    started = time.perf_counter()
    samples = SampleLog()
    metrics = validate(run, gen, prompts, version, samples)
    metrics["time/validation"] = time.perf_counter() - started
    return ValidationResult(version, metrics, samples.take("validation"))


def _rollout_min(count: int) -> int:
    """Separate `agree_min`: the minimum over the rollout ranks (ranks that score nothing pass a
    count no shard can reach)."""
    t = torch.tensor([float(count)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


__all__ = ["ColocatedRollouts", "SeparateRollouts", "serve", "needed_version"]
