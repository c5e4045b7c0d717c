"""The weight stream from trainer rank 0 to the rollout ranks over the bridge
(`mrl.platform.bridge`), separate placement: versioned, checksummed, full or delta, verified.

Trainer rank 0 (`BridgeSender`) encodes each version with a `mrl.weights.delta.WeightSender`
(`rollout.weight_sync.mode`: every tensor, or only what changed since the version the rollout
ranks hold, sparse index/value pairs where few elements changed) and broadcasts it as frames. A
frame is an int64 pair (header bytes, buffer bytes, -1: no buffer), a JSON header and, for a
bucket, one flat byte buffer (`mrl.weights.delta.pack`; tensors keep their dtype, bf16 crosses as
bf16 bytes). One sync is:

    ["sync", version, full, base, verify]     base: the version a delta applies to (-1: full)
    bucket frames ... and the End frame       (`Bucket`s and `End` as `pack` writes them)
    ["verify", version, {name: checksum}, {name: dtype}]   only when `verify`

Every rollout rank (`BridgeReceiver`) unpacks the frames into a `WeightReceiver`, which checks
each bucket's version, position and checksums before it reaches the engine and names a lost
bucket from the End; every `rollout.weight_sync.verify_every_steps` syncs it also hashes every
tensor its engine holds against the trainer's checksums. Each failure is one line naming the
tensor, the version and the engine group (`WeightSyncError`).

Which sync is full: the sender holds nothing (its first sync, a resumed or restarted trainer),
or a rollout rank does not hold the version the sender last sent it (a restarted rollout
process, an engine rebuilt: it publishes the version it holds on the store after every sync,
`weights/held/<rank>`, and -1 until its first). A rollout rank given a delta based on a version
it does not hold refuses it.

Load units (`RolloutEngine.load_unit`): an engine such as vLLM loads some tensors only together
(q/k/v into `qkv_proj`, gate/up, a module's weight with its bias), and trainer rank 0 holds no
engine to ask. So after every full sync each rollout rank publishes, before the version it holds,
what its engine told it about the tensors that sync carried: `weights/units/<rank>`, JSON
`{"sparse": takes index/value updates, "units": [[names of one unit], ...]}` (units of more than
one tensor only). Before its first delta after a full sync the sender reads them (the units of
all ranks merged) and completes units as the colocated channel does; where any rank's engine
takes no sparse updates, changed tensors go whole, so index/value pairs never reach vLLM.
"""
from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Iterable, Iterator, Optional

import torch

from mrl.platform.bridge import Bridge
from mrl.weights.delta import End, SyncStats, WeightSender, pack, unpack
from mrl.weights.verify import WeightSyncError

if TYPE_CHECKING:
    from mrl.rollout.engine import RolloutEngine
    from mrl.train.liveness import Liveness

log = logging.getLogger(__name__)


def held_key(rank: int) -> str:
    """The store key a rollout rank (global `rank`) publishes the weight version it holds on."""
    return f"weights/held/{rank}"


def units_key(rank: int) -> str:
    """The store key a rollout rank (global `rank`) publishes its engine's load units on."""
    return f"weights/units/{rank}"


def engine_units(engine: Optional["RolloutEngine"], names: Iterable[str]) -> Optional[dict]:
    """What a rollout rank publishes after a full sync of `names`: whether its engine takes sparse
    updates, and its load units of more than one tensor (None: the rank holds no engine)."""
    if engine is None:
        return None
    units: dict[str, list[str]] = {}
    for name in names:
        units.setdefault(engine.load_unit(name), []).append(name)
    return {"sparse": bool(engine.accepts_sparse), "units": [m for m in units.values() if len(m) > 1]}


def merged_units(published: Iterable[Optional[dict]]) -> tuple[dict[str, str], bool]:
    """(name -> unit id, every engine takes sparse updates) from the ranks' `engine_units`: tensors
    that any rank loads together share a unit (one rank's units, or a union if ranks differ)."""
    parent: dict[str, str] = {}

    def root(name: str) -> str:
        while parent.get(name, name) != name:
            name = parent[name]
        return name

    sparse = True
    for pub in published:
        if pub is None:
            continue
        sparse = sparse and pub["sparse"]
        for members in pub["units"]:
            for other in members[1:]:
                a, b = root(members[0]), root(other)
                if a != b:
                    parent[b] = a
    return {name: root(name) for name in parent}, sparse   # a unit's root names it (absent: its own unit)


# ------------------------------------------------------------------------------------------- frames
def send_frame(bridge: Bridge, header: bytes, flat: Optional[torch.Tensor]) -> None:
    """Broadcast one frame from trainer rank 0: sizes, JSON header, then the buffer if any."""
    size = -1 if flat is None else flat.numel()
    bridge.broadcast(torch.tensor([len(header), size], dtype=torch.int64), "weight sync frame size")
    bridge.broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8), "weight sync header")
    if flat is not None:
        bridge.broadcast(flat, f"weight sync buffer of {flat.numel()} bytes")


def receive_frame(bridge: Bridge) -> tuple[bytes, Optional[torch.Tensor]]:
    """The next frame trainer rank 0 broadcasts (the buffer on the host: `unpack` views it)."""
    sizes = bridge.broadcast(torch.zeros(2, dtype=torch.int64), "weight sync frame size").cpu()
    header = bridge.broadcast(torch.empty(int(sizes[0]), dtype=torch.uint8), "weight sync header").cpu()
    flat = None
    if int(sizes[1]) >= 0:
        flat = bridge.broadcast(torch.empty(int(sizes[1]), dtype=torch.uint8),
                                f"weight sync buffer of {int(sizes[1])} bytes").cpu()
    return header.numpy().tobytes(), flat


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


# ------------------------------------------------------------------------------------------- sender
class BridgeSender:
    """Trainer rank 0's side: what the rollout ranks hold, and the frames that bring them to a version.

    `rollout_ranks` are the global ranks that receive (each publishes the version it holds and
    its engine's load units); `accepts_sparse`: the rollout engines may take index/value updates
    (the hf engine), else changed tensors go whole, as they do where a rank's engine says it takes
    none. Used from one thread at a time (the weight sender's)."""

    def __init__(self, bridge: Bridge, rollout_ranks: list[int], *, mode: str = "full", sparse_fraction: float = 0.25,
                 bucket_mb: float = 512, verify_every_steps: int = 0, accepts_sparse: bool = True):
        self.bridge = bridge
        self.rollout_ranks = rollout_ranks
        self.sparse_fraction = sparse_fraction if accepts_sparse else 0.0
        self.sender = WeightSender(mode=mode, sparse_fraction=self.sparse_fraction,
                                   bucket_bytes=int(bucket_mb * 2**20))
        self.units_known = False   # the load units of the last full sync were read from the store
        self.verify_every_steps = verify_every_steps
        self.sent_version: Optional[int] = None   # the version the rollout ranks hold, as far as the sender knows
        self.syncs = 0
        self.seconds = 0.0   # the last sync's wall time, from the rollout ranks being ready to its last frame

    @classmethod
    def from_config(cls, bridge: Bridge, rollout_ranks: list[int], rollout) -> "BridgeSender":
        """From the `[rollout]` section: `weight_sync`, and the engine (only hf engines take sparse updates)."""
        ws = rollout.weight_sync
        return cls(bridge, rollout_ranks, mode=ws.mode, sparse_fraction=ws.sparse_fraction, bucket_mb=ws.bucket_mb,
                   verify_every_steps=ws.verify_every_steps, accepts_sparse=rollout.engine == "hf")

    def held_by_rollout_ranks(self) -> dict[int, int]:
        """global rank -> the version it says it holds (-1: none yet)."""
        store = self.bridge.store
        return {r: int(store.get(held_key(r)).decode()) if store.check([held_key(r)]) else -1
                for r in self.rollout_ranks}

    def _read_units(self) -> None:
        """The rollout engines' load units and sparse support, as the ranks published them after
        the last full sync (each publishes them before the version it holds, which the sender has
        just read, so every rank's are there)."""
        store = self.bridge.store
        missing = [r for r in self.rollout_ranks if not store.check([units_key(r)])]
        if missing:
            raise WeightSyncError(f"weight sync: rollout rank {missing[0]} holds version {self.sent_version} but "
                                  f"published no load units ({units_key(missing[0])})")
        units, sparse = merged_units(json.loads(store.get(units_key(r)).decode()) for r in self.rollout_ranks)
        self.sender.unit_of = lambda name: units.get(name, name)
        self.sender.sparse_fraction = self.sparse_fraction if sparse else 0.0
        self.units_known = True

    def send(self, stream: Iterable[tuple[str, torch.Tensor]], version: int, liveness: "Liveness") -> SyncStats:
        """Once every rollout rank waits for it, announce and broadcast version `version` of the
        actor (the HF-named tensors of `stream`); returns what the sync moved. (Both sides enter
        the broadcast only when the other is there, so no collective timeout covers a rollout or
        a training step.)"""
        liveness.wait_until_ready(version, f"weight sync of version {version}")
        started = time.perf_counter()
        held = self.held_by_rollout_ranks()
        if self.sent_version is None or any(v != self.sent_version for v in held.values()):
            self.sender.forget()   # some rollout rank lost (or never had) what was sent: full sync
        full = self.sender.mode == "full" or not self.sender.held
        if not full and not self.units_known:
            self._read_units()
        if full:
            self.units_known = False
        self.syncs += 1
        verify = bool(self.verify_every_steps) and self.syncs % self.verify_every_steps == 0
        self.bridge.store.set("weights/announced", str(version))
        stats = SyncStats(version=version, full=full)
        base = -1 if full else self.sent_version
        send_frame(self.bridge, _json(["sync", version, full, base, verify]), None)
        for msg in self.sender.encode(stream, version, stats):
            send_frame(self.bridge, *pack(msg))
        if verify:
            t0 = time.perf_counter()
            expected = {name: list(s) for name, s in self.sender.expected().items()}
            dtypes = {name: str(d).removeprefix("torch.") for name, d in self.sender.dtypes.items()}
            stats.seconds_verify = time.perf_counter() - t0
            stats.verified = True
            send_frame(self.bridge, _json(["verify", version, expected, dtypes]), None)
        self.sent_version = version
        self.seconds = time.perf_counter() - started
        return stats


# ----------------------------------------------------------------------------------------- receiver
class BridgeReceiver:
    """A rollout rank's side: checks every sync and loads it into this rank's engine (None: a rank
    holding no engine checks the buckets only). `group` names the engine group in errors."""

    def __init__(self, bridge: Bridge, engine: Optional["RolloutEngine"], group: str):
        from mrl.rollout.weight_channel import WeightReceiver

        self.bridge = bridge
        self.engine = engine
        self.receiver = WeightReceiver(engine, group)
        self.group = group
        self.held: Optional[int] = None   # the version this rank's engine holds
        self.names: list[str] = []        # the tensors of the sync being received
        self.last: Optional[SyncStats] = None
        self.warned_unreadable = False
        self._publish()

    def _publish(self) -> None:
        self.bridge.store.set(held_key(self.bridge.rank), str(-1 if self.held is None else self.held))

    def forget(self) -> None:
        """The engine lost its weights (rebuilt, or dropped them): the next sync must be full."""
        self.held = None
        self._publish()

    def receive(self, expected_version: int) -> int:
        """Receive, check and load the next sync, which must be of `expected_version`; returns it."""
        kind, version, full, base, verify = json.loads(receive_frame(self.bridge)[0])
        if kind != "sync":
            raise WeightSyncError(f"weight sync: engine group {self.group} expected the start of version "
                                  f"{expected_version}, received a {kind!r} frame")
        if version != expected_version:
            raise WeightSyncError(f"weight sync: engine group {self.group} expected policy version {expected_version}, "
                                  f"the trainer sent version {version}")
        if not full and base != self.held:
            raise WeightSyncError(f"weight sync: version {version} is a delta on version {base}, but engine group "
                                  f"{self.group} holds {'nothing' if self.held is None else f'version {self.held}'}")
        stats = SyncStats(version=version, full=full)
        self.held = None   # a sync that fails half-way leaves the engine holding neither version
        self.names = []
        self.receiver.apply(self._messages(), version, full=full, stats=stats)
        if full:   # before the version: a sender that sees it may send deltas by these units
            self.bridge.store.set(units_key(self.bridge.rank), _json(engine_units(self.engine, self.names)))
        if verify:
            kind, v, expected, dtypes = json.loads(receive_frame(self.bridge)[0])
            if kind != "verify" or v != version:
                raise WeightSyncError(f"weight sync: engine group {self.group} expected the checksums of version "
                                      f"{version}, received a {kind!r} frame of version {v}")
            if self.engine is not None and _lists_weights(self.engine):
                t0 = time.perf_counter()
                unreadable = self.receiver.verify({n: tuple(s) for n, s in expected.items()},
                                                  {n: getattr(torch, d) for n, d in dtypes.items()}, version)
                if unreadable and not self.warned_unreadable:
                    self.warned_unreadable = True
                    log.warning("weight verification: %d of %d tensors cannot be read back from the %s engine of "
                                "engine group %s (e.g. %s); they are checked on arrival only", len(unreadable),
                                len(expected), type(self.engine).__name__, self.group, unreadable[0])
                stats.seconds_verify = time.perf_counter() - t0
                stats.verified = True
        self.held = version
        self._publish()
        self.last = stats
        return version

    def _messages(self) -> Iterator:
        """The sync's buckets, then its End (the receiver stops reading there)."""
        while True:
            header, flat = receive_frame(self.bridge)
            msg = unpack(header, flat)
            if not isinstance(msg, End):
                self.names += [it.name for it in msg.items]
            yield msg
            if isinstance(msg, End):
                return


def _lists_weights(engine: "RolloutEngine") -> bool:
    """Can the engine list its tensors by HF name (`held_weights`), which the full verification reads?"""
    from mrl.rollout.engine import RolloutEngine

    return type(engine).held_weights is not RolloutEngine.held_weights
