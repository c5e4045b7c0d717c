"""`manifest.json`: what a complete checkpoint holds, so a damaged one is found before it is loaded.

The manifest is written last into a checkpoint's temporary directory (after every shard, the
common state and the RNG files) and lists each file with its size and a hash of its bytes, plus
what the checkpoint contains (step, whether the optimizer state is in it)::

    {"format": 2, "step": 20, "optimizer": true, "job": {"name": "gsm8k", "run_dir": "/runs/gsm8k"},
     "files": {"__0_0.distcp": {"bytes": 123, "xxh3_128": "..."}, "common.pt": {...}, ...}}

The hash finds bytes that changed after the save (a bad disk, a partial copy); it is no defence
against someone who can rewrite the manifest too, so it is xxHash's XXH3-128 (format 2), which
reads the files about 20x faster than SHA-256. Manifests of format 1 (SHA-256, older saves)
are still read and checked with SHA-256.

`job` names the job that saved it (`job_of`): a resume refuses another job's checkpoint, and
retention deletes only its own job's saves (checkpoints of older mrl versions have none).

`problem_in(dir, files)` names the first thing wrong with some of those files (missing,
truncated, resized, changed bytes) or returns None. Checking is split across ranks by the
caller (`mrl.checkpoint.state.verify`), so each rank hashes a share of the files. These
functions touch only the filesystem.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

__all__ = ["MANIFEST", "FORMAT", "HASH", "file_entry", "listed_files", "write", "read", "problem_in", "job_of"]

MANIFEST = "manifest.json"
FORMAT = 2
HASH = "xxh3_128"                      # what a save writes
_FORMAT_HASH = {1: "sha256", 2: "xxh3_128"}
_CHUNK = 8 << 20


def _hasher(algorithm: str):
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    raise ValueError(f"unknown manifest hash {algorithm!r}")


class ManifestError(ValueError):
    """The manifest itself is missing or unreadable; the message says which."""


def file_entry(path: Path, algorithm: Optional[str] = None) -> dict:
    """{"bytes": size, algorithm: hex digest} of one file (`algorithm`: "xxh3_128" or "sha256";
    default `HASH`)."""
    algorithm = algorithm or HASH
    h = _hasher(algorithm)
    size = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return {"bytes": size, algorithm: h.hexdigest()}


def listed_files(directory: Path) -> list[str]:
    """Every file under `directory` (relative POSIX paths, sorted), the manifest excepted."""
    directory = Path(directory)
    out = []
    for dirpath, _, files in os.walk(directory):
        for name in files:
            rel = (Path(dirpath) / name).relative_to(directory).as_posix()
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def write(directory: Path, files: dict[str, dict], *, step: int, optimizer: bool, job: Optional[dict] = None) -> Path:
    """Write (and fsync) the manifest of `directory` (`files`: `file_entry`s of one algorithm);
    `job` identifies the job saving it."""
    path = Path(directory) / MANIFEST
    algorithms = {k for entry in files.values() for k in entry if k != "bytes"}
    fmt = next((f for f, a in _FORMAT_HASH.items() if {a} == algorithms), FORMAT)
    body = {"format": fmt, "step": int(step), "optimizer": bool(optimizer), "files": dict(sorted(files.items()))}
    if job is not None:
        body["job"] = dict(job)
    with open(path, "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return path


def read(directory: Path) -> dict:
    """The manifest of `directory`; raises `ManifestError` naming what is wrong with it."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        entries = sorted(p.name for p in Path(directory).iterdir()) if Path(directory).is_dir() else []
        what = "the directory is empty" if not entries else f"it holds {', '.join(entries[:4])}" + (" ..." if len(entries) > 4 else "")
        raise ManifestError(f"no {MANIFEST} ({what}; an incomplete save, or one by an older mrl)")
    try:
        body = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{MANIFEST} is not valid JSON ({e})") from None
    files = body.get("files") if isinstance(body, dict) else None
    algorithm = _FORMAT_HASH.get(body.get("format")) if isinstance(body, dict) else None
    if algorithm is None or not isinstance(files, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get(algorithm), str)
            for v in files.values()):
        raise ManifestError(f"{MANIFEST} is not an mrl checkpoint manifest (format "
                            f"{' or '.join(str(f) for f in _FORMAT_HASH)})")
    return body


def problem_in(directory: Path, files: dict[str, dict]) -> Optional[str]:
    """The first of `files` (manifest entries) that is missing or differs from its entry, as a
    short sentence, or None when all match."""
    directory = Path(directory)
    for rel, want in sorted(files.items()):
        path = directory / rel
        if not path.is_file():
            return f"{rel} is missing"
        size = path.stat().st_size
        if size != want["bytes"]:
            what = "empty" if size == 0 else ("truncated" if size < want["bytes"] else "longer than saved")
            return f"{rel} is {what}: {size} bytes, the manifest says {want['bytes']}"
        algorithm = "sha256" if "sha256" in want else "xxh3_128"
        if file_entry(path, algorithm)[algorithm] != want[algorithm]:
            return f"{rel} does not match its checksum (its bytes changed after the save)"
    return None


def job_of(directory: Path) -> Optional[dict]:
    """The `job` the manifest of `directory` records, or None (no manifest, an unreadable one, or
    one written before checkpoints named their job)."""
    try:
        job = read(directory).get("job")
    except (ManifestError, OSError):
        return None
    return job if isinstance(job, dict) else None
