"""Reading a checkpoint directory without trusting it: nothing in it can run code.

A checkpoint may come from anywhere (`mrl merge <dir>`, `checkpoint.load_from`, a copied run), so
its files are untrusted bytes. Two pickled files matter: torch's `.metadata` (torch's reader
uses plain `pickle.load`) and megatron's `common.pt` (`torch.load`). Every command reads them
only through this module, after `problem(ckpt)` found the directory matching its manifest:

- `read_dcp_metadata`: `.metadata` through an unpickler that builds only plain data and the
  metadata dataclasses of an exact allowlist (`mrl.checkpoint.pickle_plain`);
- `read_common`: `common.pt` with `torch.load(weights_only=True)` (tensors, numbers, strings,
  lists and dicts only);
- `tensor_shapes`: global shapes and dtypes of the stored tensors, from the metadata read above
  (no megatron/torch reader opens the file).

The manifest is integrity, not authenticity (whoever crafts a checkpoint can write a matching
manifest), so the restricted readers are what keeps a crafted file from running code; the
manifest makes sure the bytes the restricted reader checked are the ones that get loaded.
Everything here is one process (no collectives) and raises one-line `UserError`s.
"""
from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from typing import Optional

import torch

from mrl.checkpoint import manifest
from mrl.checkpoint import pickle_plain as _plain
from mrl.errors import UserError

__all__ = ["PICKLED", "problem", "read_dcp_metadata", "read_common", "tensor_shapes", "TensorShape", "require"]

PICKLED = (".metadata", "common.pt")   # the files of a torch_dist checkpoint that are pickles


class _MetadataUnpickler(pickle._Unpickler):
    """Unpickles torch_dist's `.metadata` as plain checkpoint metadata and nothing else.

    Python's pure unpickler with its opcode table cut down to data (`_plain.DISPATCH`): a
    global is looked up in an exact (module, name) table (no import, no dotted names, no
    attribute walk), a call (REDUCE) is made only to `torch.Size`, `_get_layout`, an enum or
    `OrderedDict` with plain arguments, an object is created (NEWOBJ) only for one of the
    metadata dataclasses, and its state (BUILD) only set on such an instance, with that class's
    own fields. Everything else (INST, OBJ, NEWOBJ_EX, extension codes, persistent ids, buffers)
    is refused by name."""

    dispatch = _plain.DISPATCH

    def find_class(self, module: str, name: str):
        return _plain.lookup(module, name)

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("refers to a persistent id")


def problem(ckpt: str | Path) -> Optional[str]:
    """What is wrong with `ckpt` against its manifest (missing or unreadable manifest, a file
    missing or changed, a pickled file the manifest does not list), or None. One process: it
    hashes every file (`mrl.checkpoint.state.verify` is the collective version)."""
    ckpt = Path(ckpt)
    try:
        files = manifest.read(ckpt)["files"]
    except (manifest.ManifestError, OSError) as e:
        return str(e)
    unlisted = [f for f in PICKLED if f not in files]
    if unlisted:
        return f"{manifest.MANIFEST} does not list {unlisted[0]}"
    return manifest.problem_in(ckpt, files)


def require(ckpt: str | Path, what: str = "checkpoint") -> None:
    """`problem(ckpt)` as a one-line `UserError` naming `what` (e.g. "merge")."""
    found = problem(ckpt)
    if found:
        raise UserError(f"{what}: checkpoint {ckpt} was not read: {found}")


def read_dcp_metadata(ckpt: str | Path):
    """torch.distributed.checkpoint's `Metadata` of `ckpt`, through the restricted unpickler."""
    ckpt = Path(ckpt)
    try:
        with open(ckpt / ".metadata", "rb") as f:
            meta = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError, TypeError, IndexError,
            KeyError, OSError, RecursionError, MemoryError) as e:
        raise UserError(f"checkpoint {ckpt}: .metadata is not plain checkpoint metadata and was not loaded "
                        f"({str(e)[:160] or type(e).__name__})") from None
    if not isinstance(meta, _plain.metadata_class()):
        raise UserError(f"checkpoint {ckpt}: .metadata holds a {type(meta).__name__}, not torch.distributed.checkpoint "
                        "metadata, and was not loaded")
    return meta


def read_common(ckpt: str | Path) -> dict:
    """`common.pt` of `ckpt` as plain values (`torch.load(weights_only=True)`)."""
    ckpt = Path(ckpt)
    try:
        common = torch.load(ckpt / "common.pt", weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError, AttributeError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"checkpoint {ckpt}: common.pt is not plain data and was not loaded "
                        f"(only tensors and plain values are read from checkpoints): {first[:160]}") from None
    if not isinstance(common, dict):
        raise UserError(f"checkpoint {ckpt}: common.pt holds a {type(common).__name__}, not megatron's common state")
    return common


@dataclasses.dataclass(frozen=True)
class TensorShape:
    """A stored tensor's global shape and dtype (what `mrl merge` needs to rebuild the model)."""

    global_shape: tuple[int, ...]
    dtype: torch.dtype


def tensor_shapes(ckpt: str | Path) -> dict[str, TensorShape]:
    """ShardedTensor key -> `TensorShape` of every tensor in `ckpt`, from `read_dcp_metadata`."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = read_dcp_metadata(ckpt)
    entries = getattr(meta, "state_dict_metadata", None)
    if not isinstance(entries, dict):
        raise UserError(f"checkpoint {ckpt}: .metadata holds no tensor table (not a torch_dist checkpoint)")
    return {k: TensorShape(tuple(int(n) for n in v.size), v.properties.dtype)
            for k, v in entries.items() if isinstance(v, TensorStorageMetadata)}
