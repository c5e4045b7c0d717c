"""The receiving side of a weight sync, and the colocated channel that joins both sides in a rank.

`WeightReceiver` takes the sender's messages (`mrl.weights.delta`: `Bucket`s, then an `End`) and
loads them into an engine. Before a bucket's tensors reach the engine it checks the bucket's
version and position and every payload's checksum; a lost bucket is named from the `End` marker
(its tensors), and a sync whose `End` never comes is an error too. Each failure is one line
naming the tensor, the version and the engine group (`WeightSyncError`). Sparse items go to the
engine's `apply_sparse`; whole tensors stream through one `update_weights` call (vLLM wraps a
sync in a start/finish pair), `partial` for a delta sync.

`verify` is the periodic full verification (`rollout.weight_sync.verify_every_steps`): the
checksum of every tensor the engine holds, cast to the export dtype, against the sender's. A
bucket's payloads, and a verification's tensors in batches of up to `VERIFY_BATCH_BYTES`, are
hashed together (`mrl.weights.verify.first_mismatch`: on a GPU one kernel launch and one host
read per batch).

`ColocatedChannel` is the colocated sync of one engine: sender and receiver in the same process,
`transit` in between (none in a run; tests corrupt or drop buckets there). Without a transit the
receiver still checks every bucket's version and position and names lost buckets, but does not
rehash the payloads: they are the very tensors the sender hashed a moment before in the same
process, so a second hash could not differ. Each sum is computed once, on the sender, and what
the engine made of the bytes is what the periodic verification checks.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, Iterator, Optional

import torch

from mrl.rollout.engine import RolloutEngine
from mrl.weights.delta import Bucket, End, SyncStats, WeightSender
from mrl.weights.verify import Checksum, WeightSyncError, first_mismatch

Messages = Iterable[Bucket | End]
log = logging.getLogger(__name__)
VERIFY_BATCH_BYTES = 256 * 2**20   # verification: read-back tensors hashed together, at most about this much held


class WeightReceiver:
    """Checks and loads one engine's syncs; `group` names the engine group in errors."""

    def __init__(self, engine: Optional[RolloutEngine], group: str):
        self.engine = engine   # None: a rank holding no engine checks the buckets only
        self.group = group

    def apply(self, messages: Messages, version: int, *, full: bool, stats: Optional[SyncStats] = None,
              rehash: bool = True) -> int:
        """Load one sync of policy `version`; returns the tensors loaded (whole and sparse).
        `rehash=False`: the payloads are the sender's own tensors (colocated, nothing in between),
        so their checksums are not recomputed; versions, positions and lost buckets still are checked."""
        stats = stats if stats is not None else SyncStats(version=version, full=full)
        counted = {"sparse": 0}
        checked = self._checked(iter(messages), version, stats, counted, rehash)
        whole = (sum(1 for _ in checked) if self.engine is None
                 else self.engine.update_weights(checked, partial=not full))
        return whole + counted["sparse"]

    def _checked(self, messages: Iterator, version: int, stats: SyncStats, counted: dict,
                 rehash: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        expected_index = 0
        lost: list[int] = []
        end: Optional[End] = None
        for msg in messages:
            if isinstance(msg, End):
                end = msg
                break
            first = msg.items[0].name if msg.items else "-"
            if msg.version != version:
                raise WeightSyncError(f"weight sync: bucket {msg.index} (first tensor {first}) carries version "
                                      f"{msg.version}, engine group {self.group} expected version {version}")
            if msg.index < expected_index:
                raise WeightSyncError(f"weight sync: bucket {msg.index} (first tensor {first}) of version {version} "
                                      f"arrived twice at engine group {self.group}")
            lost += range(expected_index, msg.index)
            expected_index = msg.index + 1
            t0 = time.perf_counter()
            bad = first_mismatch([it.checksum for it in msg.items], [it.payloads for it in msg.items]) if rehash else None
            if bad is not None:
                raise WeightSyncError(f"weight sync: {msg.items[bad].name} (version {version}, bucket {msg.index}) "
                                      f"failed its checksum at engine group {self.group}")
            stats.seconds_checksums += time.perf_counter() - t0
            for item in msg.items:
                if item.sparse:
                    if self.engine is not None and not self.engine.accepts_sparse:
                        raise WeightSyncError(f"weight sync: {item.name} (version {version}, bucket {msg.index}) "
                                              f"arrived as index/value pairs at engine group {self.group}, whose "
                                              f"{type(self.engine).__name__} engine loads whole tensors only")
                    if self.engine is not None:
                        self.engine.apply_sparse(item.name, item.indices, item.values)
                    counted["sparse"] += 1
                else:
                    yield item.name, item.values
        if end is None:
            raise WeightSyncError(f"weight sync: version {version} ended at engine group {self.group} after bucket "
                                  f"{expected_index - 1} without its end marker (buckets were lost)")
        if end.version != version:
            raise WeightSyncError(f"weight sync: the end of version {end.version} reached engine group {self.group}, "
                                  f"which expected version {version}")
        lost += range(expected_index, len(end.buckets))
        if lost:
            names = end.buckets[lost[0]]
            more = f" and {len(lost) - 1} more bucket(s)" if len(lost) > 1 else ""
            raise WeightSyncError(f"weight sync: bucket {lost[0]} of version {version} (tensors {names[0]} .. "
                                  f"{names[-1]}, {len(names)} in all) never arrived at engine group {self.group}{more}")

    def verify(self, expected: dict[str, Checksum], dtypes: dict[str, torch.dtype], version: int) -> list[str]:
        """Every tensor the engine holds hashes to what the sender sent it (cast to the export dtype).
        Returns the tensors the engine cannot read back (checked on arrival only)."""
        seen, unreadable, batch = set(), [], []

        def check():   # a batch of tensors hashed together (`first_mismatch`: one launch on a GPU)
            bad = first_mismatch([expected[n] for n, _ in batch], [(t,) for _, t in batch])
            if bad is not None:
                raise WeightSyncError(f"weight verification: {batch[bad][0]} at engine group {self.group} differs "
                                      f"from the trainer's version {version}")
            batch.clear()

        for name, held in self.engine.held_weights(sorted(expected)):   # read back one tensor at a time
            seen.add(name)
            if held is None:
                unreadable.append(name)
                continue
            batch.append((name, held.detach().to(dtypes.get(name, held.dtype))))
            if sum(t.numel() * t.element_size() for _, t in batch) >= VERIFY_BATCH_BYTES:   # a few hundred tensors
                check()
        if batch:
            check()
        for name in sorted(set(expected) - seen):
            raise WeightSyncError(f"weight verification: engine group {self.group} holds no {name} (version {version})")
        return unreadable


class ColocatedChannel:
    """One colocated engine's weight sync: full or delta, checksummed, periodically verified."""

    def __init__(self, engine: RolloutEngine, *, mode: str = "full", sparse_fraction: float = 0.25,
                 bucket_mb: float = 512, verify_every_steps: int = 0, group: str = "0",
                 transit: Optional[Callable[[Messages], Messages]] = None):
        if not engine.accepts_sparse:
            sparse_fraction = 0.0   # changed tensors go whole
        self.sender = WeightSender(mode=mode, sparse_fraction=sparse_fraction, bucket_bytes=int(bucket_mb * 2**20),
                                   unit_of=engine.load_unit)
        self.receiver = WeightReceiver(engine, group)
        self.verify_every_steps = verify_every_steps
        self.transit = transit   # None: the receiver gets the sender's own tensors (not rehashed)
        self.syncs = 0
        self.last: Optional[SyncStats] = None
        self.reported: Optional[SyncStats] = None   # the stats `channel_metrics` returned last
        self.warned_unreadable = False

    @classmethod
    def from_config(cls, engine: RolloutEngine, config, group: str = "0") -> "ColocatedChannel":
        """From `rollout.weight_sync`."""
        return cls(engine, mode=config.mode, sparse_fraction=config.sparse_fraction, bucket_mb=config.bucket_mb,
                   verify_every_steps=config.verify_every_steps, group=group)

    def push(self, stream: Iterable[tuple[str, torch.Tensor]], version: int, *, lost: bool = False) -> int:
        """Bring the engine to the weights of `stream` (policy `version`); `lost`: the engine no
        longer holds what was last sent (sleep level 2), so the sync is full. Returns tensors loaded."""
        if lost:
            self.sender.forget()
        full = self.sender.mode == "full" or not self.sender.held
        stats = SyncStats(version=version, full=full)
        messages = self.sender.encode(stream, version, stats)
        if self.transit is not None:
            messages = self.transit(messages)
        sent = self.receiver.apply(messages, version, full=full, stats=stats, rehash=self.transit is not None)
        self.syncs += 1
        if self.verify_every_steps and self.syncs % self.verify_every_steps == 0:
            t0 = time.perf_counter()
            unreadable = self.receiver.verify(self.sender.expected(), self.sender.dtypes, version)
            if unreadable and not self.warned_unreadable:
                self.warned_unreadable = True
                log.warning("weight verification: %d of %d tensors cannot be read back from the %s engine (e.g. %s); "
                            "they are checked on arrival only", len(unreadable), len(self.sender.dtypes),
                            type(self.receiver.engine).__name__, unreadable[0])
            stats.seconds_verify = time.perf_counter() - t0
            stats.verified = True
        self.last = stats
        return sent


def channel_metrics(channel: Optional[ColocatedChannel]) -> dict[str, float]:
    """`weight_sync/*` metrics of the sync since the last call (none when nothing was sent since,
    or where this rank holds no engine)."""
    if channel is None or channel.last is None or channel.reported is channel.last:
        return {}
    channel.reported = channel.last
    return channel.last.metrics()
