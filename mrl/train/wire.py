"""The weight stream from trainer rank 0 to the rollout ranks over the bridge
(`mrl.platform.bridge`), separate placement.

A version is broadcast in buckets: each bucket is a header (its version and the names, shapes and
dtypes of its tensors) and one flat byte buffer; an empty bucket ends the version. Tensors keep
their dtype (bf16 crosses as bf16 bytes).
"""
from __future__ import annotations

import pickle
from typing import TYPE_CHECKING

import torch

from mrl.platform.bridge import Bridge

if TYPE_CHECKING:
    from mrl.train.liveness import Liveness


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
