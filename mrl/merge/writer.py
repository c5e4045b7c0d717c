"""Sharded safetensors output, written bucket by bucket as the weight stream arrives.

Each bucket (at most `max_shard_bytes`, a larger single tensor alone) becomes one shard file the
moment it is complete, so the writer never holds more than one bucket. The final shard names
(`model-00001-of-00003.safetensors`, Hugging Face's convention) need the shard count, known only
at the end: shards are written under provisional names and renamed by `finish`, which also
writes `model.safetensors.index.json`.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterable

import torch

from mrl.errors import UserError

INDEX_NAME = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes from `2GB`, `500MB`, `1.5GiB` or a plain integer (decimal units, as `transformers`)."""
    if isinstance(text, int):
        size = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise UserError(f"--max-shard-size: cannot read {text!r} (e.g. 2GB, 500MB, 1GiB)")
        size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise UserError(f"--max-shard-size: must be positive, got {text!r}")
    return size


def _owned(t: torch.Tensor) -> torch.Tensor:
    """`t` as a contiguous tensor that owns exactly its bytes (safetensors refuses shared storage)."""
    t = t.detach().contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def current_umask() -> int:
    """The process umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_tensors(tensors: Iterable[tuple[str, torch.Tensor]], path: Path) -> int:
    """Write (name, tensor) pairs as one safetensors file; returns its tensor bytes."""
    from safetensors.torch import save_file

    data = {name: _owned(t) for name, t in tensors}
    save_file(data, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~current_umask())   # safetensors writes 0600 (a temp file); HF exports are 0644
    return sum(t.numel() * t.element_size() for t in data.values())


class ShardWriter:
    """Writes buckets of HF tensors as numbered shards of one model directory."""

    def __init__(self, out_dir: Path, prefix: str = "model"):
        self.out_dir = Path(out_dir)
        self.prefix = prefix
        self.shards: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0
        self._seen: set[str] = set()

    def write(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        names = [name for name, _ in bucket]
        dup = next((n for n in names if n in self._seen), None)
        if dup is not None:
            raise RuntimeError(f"merge: tensor {dup!r} was exported twice")
        self._seen.update(names)
        path = self.out_dir / f"{self.prefix}-{len(self.shards) + 1:05d}.partial.safetensors"
        self.total_bytes += save_tensors(bucket, path)
        self.shards.append((path, names))

    def finish(self) -> dict:
        """Give the shards their final names and write the index; returns the index."""
        if not self.shards:
            raise RuntimeError("merge: the weight stream was empty")
        n = len(self.shards)
        weight_map: dict[str, str] = {}
        for i, (path, names) in enumerate(self.shards, start=1):
            final = f"{self.prefix}-{i:05d}-of-{n:05d}.safetensors"
            path.rename(self.out_dir / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return index
