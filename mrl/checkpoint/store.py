"""Checkpoint directory bookkeeping: atomic commits, the `latest` pointer, retention.

Layout of a checkpoint root::

    root/
      step_00000012/        a complete checkpoint (only ever created by a rename)
      step_00000016/
      latest                text file: "step_00000016"
      .tmp.step_00000020/   a save in progress (or one killed mid-way: never read, removed later)

A save writes everything into `.tmp.<name>`, fsyncs every file and directory, renames it to
`<name>` (atomic on POSIX), then replaces `latest` atomically (write `latest.tmp`, fsync,
`os.replace`). A crash at any point leaves `latest` naming a complete checkpoint.
These functions touch only the filesystem; the caller runs them on one rank.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
from pathlib import Path
from typing import Optional

from mrl.errors import UserError

__all__ = ["step_name", "tmp_path", "fsync_tree", "commit", "write_latest", "latest", "checkpoints",
           "prune", "remove_stale_tmp", "root_containing", "step_of", "check_writable", "pointed"]

LATEST = "latest"
_STEP = re.compile(r"^step_(\d{8,})$")
_TMP_PREFIX = ".tmp."


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: Path) -> Optional[int]:
    """The step of a checkpoint directory name, or None if it is not one."""
    m = _STEP.match(Path(path).name)
    return int(m.group(1)) if m else None


def tmp_path(root: Path, step: int) -> Path:
    return Path(root) / f"{_TMP_PREFIX}{step_name(step)}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file, then every directory (deepest first), under `path`."""
    dirs = []
    for dirpath, _, files in os.walk(path):
        dirs.append(dirpath)
        for f in files:
            _fsync(Path(dirpath) / f)
    for d in reversed(dirs):
        _fsync(Path(d))


def write_latest(root: Path, name: str) -> None:
    """Point `root/latest` at `name` atomically."""
    root = Path(root)
    tmp = root / f"{LATEST}.tmp"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    _fsync(root)


def commit(root: Path, tmp: Path, step: int) -> Path:
    """Make the fully written `tmp` the checkpoint of `step` and point `latest` at it."""
    root = Path(root)
    fsync_tree(tmp)
    final = root / step_name(step)
    if final.exists():  # the same step saved again (e.g. after a resume): retire the old copy first
        old = root / f"{_TMP_PREFIX}old.{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        _fsync(root)
        os.rename(tmp, final)
        _fsync(root)
        write_latest(root, final.name)
        shutil.rmtree(old, ignore_errors=True)
        return final
    os.rename(tmp, final)
    _fsync(root)
    write_latest(root, final.name)
    return final


def _inside(root: Path, path: Path) -> bool:
    """`path` is a directory of `root` itself once symlinks are followed (not a link out of it)."""
    try:
        return path.resolve().parent == root.resolve()
    except (OSError, RuntimeError):
        return False


def checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest step first (a `step_*` symlink leading out of
    `root` is not one of them)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(step_of(p), p) for p in root.iterdir()
             if p.is_dir() and step_of(p) is not None and _inside(root, p)]
    return [p for _, p in sorted(found)]


def pointed(root: Path) -> Optional[Path]:
    """The path `root/latest` names, or None without a pointer. The pointer may name only a
    `step_XXXXXXXX` directory inside `root`: an absolute path, `..`, any other name, or a step
    that is a symlink leading out of `root` is a one-line `UserError` (a run resuming from a
    foreign checkpoint would load and then log over someone else's state)."""
    root = Path(root)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    try:
        raw = pointer.read_bytes()[:4096].decode("utf-8", "replace").strip()
    except OSError as e:
        raise UserError(f"checkpoint: {pointer} cannot be read ({e.strerror or e})") from None
    target = root / raw
    if step_of(Path(raw)) is None or raw != Path(raw).name:
        raise UserError(f"checkpoint: {pointer} names {raw[:200]!r}; a `latest` may only name a step_XXXXXXXX "
                        f"directory inside {root} (refused, nothing was loaded)")
    if target.is_symlink() and not _inside(root, target):
        raise UserError(f"checkpoint: {pointer} names {raw!r}, a symlink leading out of {root} to "
                        f"{target.resolve()} (refused, nothing was loaded)")
    return target


def latest(root: Path) -> Optional[Path]:
    """The checkpoint `latest` names; without a pointer (or one naming a step not on disk), the
    highest complete step; None if none. A pointer leading out of `root` is a `UserError` (`pointed`)."""
    root = Path(root)
    target = pointed(root)
    if target is not None and target.is_dir():
        return target
    found = checkpoints(root)
    return found[-1] if found else None


def root_containing(path: Path) -> Optional[Path]:
    """The checkpoint root `path` is or lies inside (a directory with a `latest` pointer or a
    complete `step_*` checkpoint), None when it is outside every root. What is written there
    belongs to the checkpoints: retention deletes it, or a `step_*` name takes a slot."""
    p = Path(path).resolve()
    for cand in (p, *p.parents):
        if (cand / LATEST).is_file() or checkpoints(cand):
            return cand
    return None


def remove_stale_tmp(root: Path) -> list[Path]:
    """Delete leftovers of interrupted saves (`.tmp.*`); returns what was removed."""
    root = Path(root)
    gone = [p for p in root.iterdir() if p.name.startswith(_TMP_PREFIX)] if root.is_dir() else []
    for p in gone:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return gone


def prune(root: Path, keep_last: int, owner: Optional[dict] = None) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints (never the one `latest` names). With
    `owner` (a job identity, `manifest.job_of`), only that job's own checkpoints are counted and
    deleted: a save of another job (or of no recorded job) in the same directory is never touched."""
    from mrl.checkpoint.manifest import job_of

    mine = [p for p in checkpoints(root) if owner is None or job_of(p) == owner]
    keep = set(mine[-keep_last:]) if keep_last > 0 else set()
    current = latest(root)
    removed = []
    for p in mine:
        if p not in keep and p != current:
            shutil.rmtree(p)
            removed.append(p)
    return removed


def check_writable(path: Path, need_bytes: int, key: str) -> None:
    """Before any training: `path` can be created and written (a probe file is written, fsynced
    and removed) and has `need_bytes` free. A one-line `UserError` naming `key` otherwise."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".mrl-write-test.{socket.gethostname()}.{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"mrl")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        raise UserError(f"{key}: {path} is not writable ({e.strerror or e})") from None
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        raise UserError(f"{key}: {path} has {free / 2**30:.2f} GiB free; one checkpoint of this model needs about "
                        f"{need_bytes / 2**30:.2f} GiB (No space left on device at the first save otherwise)")
