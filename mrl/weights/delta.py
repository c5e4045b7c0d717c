"""The sending side of a weight sync: versioned, checksummed buckets, full or delta.

`WeightSender` turns the exporter's stream of full HF-named tensors into `Bucket`s for one engine.
Every bucket carries the policy version, its position in the sync and a checksum per payload
(`mrl.weights.verify.checksum`: one pass over the bytes where the exported tensor lives, xxh3 in
host memory, a fused wsum32 kernel on the GPU, one launch for a whole bucket); the sync ends with an
`End` marker naming every bucket's tensors, so the receiver can name what a lost bucket held.

`rollout.weight_sync.mode = "delta"`: the sender keeps what the engine holds, a host copy of every
tensor in the export dtype, and compares each newly exported tensor with it bit for bit. An
unchanged tensor is not sent; a tensor with fewer than `sparse_fraction` of its elements changed
goes as (int32 or int64 indices, new values) when that is smaller than the tensor, else whole.
Values are the new exported bytes, never differences, so the engine ends bit-identical to a full
sync. A sync is full (everything, whole) when the sender holds nothing for the engine: the first
sync, after the engine lost its weights (`forget`: sleep level 2, a restart) and after a resume
(a new process). LoRA actors export merged tensors, so only those whose adapters moved differ.

Load units: an engine may load some tensors only together (`RolloutEngine.load_unit`: vLLM
rebuilds a fused module such as `qkv_proj` from what one sync loads, so q, k and v, and a layer's
bias with its weight, arrive together or not at all). In a delta sync, when one tensor of a unit
changed, the unit's other tensors go too, whole (their new bytes equal the held ones).

`mode = "full"` keeps no copy, only each tensor's checksum (what the periodic full verification
compares the engine's weights with); delta keeps both, the checksums updated as syncs go: a whole
tensor's is its payload's, a sparse one's is updated from the words its changed elements sit in
(`mrl.weights.verify.checksum_update`: wsum32 is linear; an xxh3 sum, a host tensor's, is
rehashed), so a verification never rehashes the copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Literal, Optional

import torch

from mrl.weights.verify import Checksum, checksum, checksum_many, checksum_update, same_bits

Mode = Literal["full", "delta"]


@dataclass
class Item:
    """One tensor's payload: whole (`values` has the tensor's shape) or sparse (`indices` into the
    flattened tensor, `values` the new elements)."""

    name: str
    shape: tuple[int, ...]
    values: torch.Tensor
    indices: Optional[torch.Tensor] = None
    checksum: Optional[Checksum] = None

    @property
    def sparse(self) -> bool:
        return self.indices is not None

    @property
    def nbytes(self) -> int:
        n = self.values.numel() * self.values.element_size()
        return n + (self.indices.numel() * self.indices.element_size() if self.indices is not None else 0)

    @property
    def payloads(self) -> tuple[torch.Tensor, ...]:
        """What travels: the values, then the indices if sparse."""
        return (self.values,) if self.indices is None else (self.values, self.indices)

    def payload_checksum(self, algorithm: Optional[str] = None) -> Checksum:
        """The checksum of the payloads as one byte stream (what the receiver recomputes, with the
        algorithm of the checksum it was sent)."""
        return checksum(*self.payloads, algorithm=algorithm or (self.checksum[0] if self.checksum else None))


@dataclass
class Bucket:
    """Part of one sync: `index` counts from 0 within `version`."""

    version: int
    index: int
    items: list[Item]

    @property
    def nbytes(self) -> int:
        return sum(it.nbytes for it in self.items)


@dataclass
class End:
    """The last message of a sync: how many buckets it had and which tensors each carried."""

    version: int
    buckets: list[list[str]]
    full: bool


@dataclass
class SyncStats:
    """What one sync moved (figures for metrics and the benchmark)."""

    version: int
    full: bool
    tensors: int = 0                  # tensors exported
    tensors_sent: int = 0             # sent whole or sparse
    tensors_sparse: int = 0
    elements: int = 0
    elements_changed: int = 0         # delta mode: elements whose bits differ from the engine's
    bytes_full: int = 0               # what a full sync moves
    bytes_sent: int = 0
    buckets: int = 0
    seconds_checksums: float = 0.0    # sender and receiver checksums
    seconds_verify: float = 0.0       # periodic full verification
    verified: bool = False
    compared: bool = False            # delta mode: elements_changed was measured (full mode sends all)

    def metrics(self) -> dict[str, float]:
        out = {"weight_sync/bytes": float(self.bytes_sent), "weight_sync/bytes_full": float(self.bytes_full),
               "weight_sync/full": float(self.full), "weight_sync/tensors_sent": float(self.tensors_sent),
               "time/weight_sync_checksum": self.seconds_checksums, "time/weight_sync_verify": self.seconds_verify}
        if self.compared:
            out["weight_sync/changed_fraction"] = self.elements_changed / max(self.elements, 1)
        return out


def _own_unit(name: str) -> str:
    return name


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


@dataclass
class WeightSender:
    """What one engine holds, and the buckets that bring it to the trainer's current weights."""

    mode: Mode = "full"
    sparse_fraction: float = 0.25
    bucket_bytes: int = 512 * 2**20
    held: dict[str, torch.Tensor] = field(default_factory=dict)      # delta: host copy, export dtype
    sums: dict[str, Checksum] = field(default_factory=dict)          # full: checksum of what the engine holds
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    unit_of: Callable[[str], str] = _own_unit   # the engine's load unit of a tensor (`RolloutEngine.load_unit`)

    def forget(self) -> None:
        """The engine lost its weights: the next sync is full."""
        self.held.clear()
        self.sums.clear()

    def expected(self) -> dict[str, Checksum]:
        """name -> checksum of the tensor the engine should hold now (for the full verification):
        kept as the syncs go, never by rehashing the host copy (a whole tensor's is its payload's,
        a sparse one's is updated from the words its changed elements sit in)."""
        return dict(self.sums)

    def encode(self, stream: Iterable[tuple[str, torch.Tensor]], version: int,
               stats: Optional[SyncStats] = None) -> Iterator[Bucket | End]:
        """Buckets of `stream` for policy `version`, then an `End`. Full when nothing is held."""
        full = self.mode == "full" or not self.held
        stats = stats if stats is not None else SyncStats(version=version, full=full)
        stats.full = full
        stats.compared = self.mode == "delta" and not full
        names: list[list[str]] = []
        items: list[Item] = []
        size = 0
        for name, tensor, item in self._by_unit(stream, full, stats):
            self.dtypes[name] = tensor.dtype
            stats.tensors_sent += 1
            stats.tensors_sparse += item.sparse
            stats.bytes_sent += item.nbytes
            if items and size + item.nbytes > self.bucket_bytes:
                names.append([it.name for it in items])
                yield self._sealed(Bucket(version, len(names) - 1, items), stats)
                items, size = [], 0
            items.append(item)
            size += item.nbytes
        if items:
            names.append([it.name for it in items])
            yield self._sealed(Bucket(version, len(names) - 1, items), stats)
        stats.buckets = len(names)
        yield End(version, names, full)

    def _sealed(self, bucket: Bucket, stats: SyncStats) -> Bucket:
        """`bucket` with every item's checksum, computed together (`checksum_many`: one kernel
        launch and one host read per bucket for device tensors); a whole item's is kept as the
        checksum of what the engine will hold."""
        import time

        t0 = time.perf_counter()
        for item, sums in zip(bucket.items, checksum_many([it.payloads for it in bucket.items])):
            item.checksum = sums
            if not item.sparse:
                self.sums[item.name] = sums
        stats.seconds_checksums += time.perf_counter() - t0
        return bucket

    def _by_unit(self, stream: Iterable[tuple[str, torch.Tensor]], full: bool,
                 stats: SyncStats) -> Iterator[tuple[str, torch.Tensor, Item]]:
        """(name, tensor, item) of every tensor to send. A delta sync holds a unit's tensors back
        until the unit's last one has been seen (units are consecutive in the exporter's order,
        so this holds one module), then sends all of them when any changed."""
        units: dict[str, set[str]] = {}
        if not full:
            for held in self.held:
                units.setdefault(self.unit_of(held), set()).add(held)
        pending: dict[str, list[tuple[str, torch.Tensor, Optional[Item]]]] = {}
        for name, tensor in stream:
            tensor = tensor.detach()
            stats.tensors += 1
            stats.elements += tensor.numel()
            stats.bytes_full += tensor.numel() * tensor.element_size()
            item = self._item(name, tensor, full, stats)
            unit = self.unit_of(name) if not full else name
            members = units.get(unit, {name})
            if len(members) <= 1:
                if item is not None:
                    yield name, tensor, item
                continue
            waiting = pending.setdefault(unit, [])
            waiting.append((name, tensor, item))
            if {n for n, _, _ in waiting} >= members:
                yield from self._unit_items(pending.pop(unit))
        for waiting in pending.values():   # a unit some of whose tensors the stream did not carry
            yield from self._unit_items(waiting)

    @staticmethod
    def _unit_items(waiting: list) -> Iterator[tuple[str, torch.Tensor, Item]]:
        if any(item is not None for _, _, item in waiting):
            for name, tensor, item in waiting:
                yield name, tensor, (item if item is not None and not item.sparse
                                     else Item(name, tuple(tensor.shape), tensor))

    def _item(self, name: str, tensor: torch.Tensor, full: bool, stats: SyncStats) -> Optional[Item]:
        shape = tuple(tensor.shape)
        if self.mode == "full":
            stats.elements_changed += tensor.numel()
            return Item(name, shape, tensor)
        old = self.held.get(name)
        host = tensor.to("cpu", copy=True) if tensor.device.type != "cpu" or old is None else tensor
        if full or old is None or old.shape != tensor.shape or old.dtype != tensor.dtype:
            self.held[name] = host.clone() if host is tensor else host
            stats.elements_changed += tensor.numel()
            return Item(name, shape, tensor)
        changed = ~same_bits(host, old).reshape(-1)
        count = int(changed.sum())
        stats.elements_changed += count
        if count == 0:
            return None
        if count < self.sparse_fraction * tensor.numel():
            idx = changed.nonzero().reshape(-1).to(_index_dtype(tensor.numel()))
            self.sums[name] = checksum_update(self.sums[name], old, host, idx)   # a whole item resets it
            old.copy_(host)   # the engine holds the new bytes once this sync lands
            values = tensor.reshape(-1)[idx.to(tensor.device)]
            sparse = Item(name, shape, values, indices=idx.to(tensor.device))
            if sparse.nbytes < tensor.numel() * tensor.element_size():
                return sparse
        old.copy_(host)
        return Item(name, shape, tensor)


def pack(msg: Bucket | End) -> tuple[bytes, Optional[torch.Tensor]]:
    """A message as (JSON header, one flat uint8 buffer of its payloads or None) for a byte
    transport such as the trainer/rollout bridge (one object broadcast, one tensor broadcast).
    The checksums travel in the header, so the receiver checks what the buffer delivered (xxh3 of
    the host bytes that cross, whatever the sender's tensors hashed with on their device). The
    header is plain JSON, never a pickle: the receiver decodes it without running code."""
    import json

    if isinstance(msg, End):
        return json.dumps(["end", msg.version, msg.buckets, msg.full]).encode(), None
    meta, parts = [], []
    for it in msg.items:
        tensors = [it.values] + ([it.indices] if it.indices is not None else [])
        raws = [t.detach().contiguous().reshape(-1).view(torch.uint8).cpu() for t in tensors]
        # the bytes that cross are host bytes: a device checksum is replaced by theirs, which the
        # receiver checks at host speed (the device sum stays the sender's, for the verification)
        sums = it.checksum if it.checksum is None or it.checksum[0] == "xxh3" else checksum(*raws, algorithm="xxh3")
        meta.append((it.name, it.shape, sums, [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors]))
        for raw in raws:   # each payload starts 8-byte aligned, so the receiver can view it in place
            parts += [raw, torch.zeros(-raw.numel() % 8, dtype=torch.uint8)]
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return json.dumps(["bucket", msg.version, msg.index, meta]).encode(), flat


def unpack(header: bytes, flat: Optional[torch.Tensor]) -> Bucket | End:
    """The inverse of `pack` (views into `flat`; nothing is checked here: the receiver checks)."""
    import json

    kind, version, *rest = json.loads(header)
    if kind == "end":
        return End(version, rest[0], rest[1])
    index, meta = rest
    items, offset = [], 0
    for name, shape, sums, tensors in meta:
        views = []
        for t_shape, dtype in tensors:
            dt = getattr(torch, dtype)
            n = torch.Size(t_shape).numel() * torch.empty((), dtype=dt).element_size()
            views.append(flat[offset:offset + n].view(dt).reshape(t_shape))
            offset += n + (-n % 8)
        items.append(Item(name, tuple(shape), views[0], indices=views[1] if len(views) > 1 else None,
                          checksum=tuple(sums)))
    return Bucket(version, index, items)
