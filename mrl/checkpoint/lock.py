"""One run, one writer: exclusive locks on the run directory and on the checkpoint directory for
the life of a run.

Two launches of one job into one output directory would otherwise share its checkpoints and its
MLflow run: one deletes the other's save in progress (the stale-temp cleanup), both log rows for
the same steps. Two different jobs given one `checkpoint.dir` collide the same way, so the
checkpoint directory has a lock of its own. `RunLock` holds `flock(LOCK_EX)` on
`<directory>/.mrl.lock` from before the first checkpoint or MLflow access to the run's end; the
file records who holds it (pid, host, start time, command), so the second launch fails in one
line naming the holder and the setting (`job.output_dir` or `checkpoint.dir`).

The lock file is opened with `O_NOFOLLOW` and must be a regular file: a `.mrl.lock` that is a
symlink (to a file outside the run, which the record would overwrite) or a FIFO is refused in
one line.

The kernel drops the lock when its process dies, however it dies; the record stays. A lock
taken over a record that was never cleared is a stale lock of a dead process: it is said and
taken over. A clean release clears the record (the file stays: removing it would let a third
process lock a new file while a second still waits on the old one).

Under torchrun or srun only the rank that owns the run directory (global rank 0) locks; the
others learn its outcome through the launcher's store (`agree_on_lock`), so a refused launch
fails on every rank with one line printed once.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
import stat
import sys
from pathlib import Path
from typing import Callable, Optional

from mrl.errors import UserError

log = logging.getLogger(__name__)

LOCK_FILE = ".mrl.lock"


def _holder_text(record: dict) -> str:
    return (f"pid {record.get('pid', '?')} on {record.get('host', '?')} since {record.get('started', '?')}"
            + (f" ({record['command']})" if record.get("command") else ""))


def _read_record(f) -> Optional[dict]:
    f.seek(0)
    text = f.read().strip()
    if not text:
        return None
    try:
        record = json.loads(text)
        return record if isinstance(record, dict) else {"raw": text[:200]}
    except json.JSONDecodeError:
        return {"raw": text[:200]}


# what each locked directory is called in messages, and how to get out of the way
_WHAT = {"job.output_dir": ("the run directory", "give this one another job.name or job.output_dir"),
         "checkpoint.dir": ("the checkpoint directory", "two jobs cannot share one checkpoint.dir: give this one "
                                                        "its own checkpoint.dir")}


def _open_lock_file(path: Path, key: str):
    """`path` opened read-write (created 0644), never through a symlink, and only if it is a
    regular file; `UserError` naming it otherwise."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
    except OSError as e:
        if os.path.islink(path):
            raise UserError(f"{key}: the lock file {path} is a symlink (to {os.readlink(path)}); refusing to "
                            "follow it: remove it") from None
        raise UserError(f"{key}: the lock file {path} cannot be opened ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UserError(f"{key}: the lock file {path} is not a regular file; remove it")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "r+")


class RunLock:
    """The lock of one directory (the run's, or with `key="checkpoint.dir"` the checkpoint
    directory); `acquire()` raises `UserError` naming the holder."""

    def __init__(self, run_dir: str | os.PathLike, *, say: Callable[[str], None] | None = None,
                 key: str = "job.output_dir"):
        self.run_dir = Path(run_dir)
        self.key = key
        self.path = self.run_dir / LOCK_FILE
        self._file = None
        self._say = say or log.warning
        self.took_over: Optional[dict] = None   # the record of a dead holder this lock replaced

    def acquire(self) -> "RunLock":
        what, way_out = _WHAT[self.key]
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"{self.key}: {self.run_dir} is not writable ({e.strerror})") from None
        f = _open_lock_file(self.path, self.key)
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_record(f)
            f.close()
            who = _holder_text(holder) if holder else "another process (it has not written its record yet)"
            raise UserError(f"{self.key}: {what} {self.run_dir} is in use by {who}; wait for that "
                            f"run to end, or {way_out}") from None
        except OSError as e:   # a filesystem without locks: say so, run unlocked
            self._say(f"run lock: {self.path} cannot be locked on this filesystem ({e.strerror}); "
                      f"nothing stops a second launch into {what} {self.run_dir}")
            f.close()
            return self
        stale = _read_record(f)
        if stale:
            self.took_over = stale
            self._say(f"run lock: took over the stale lock of {_holder_text(stale)}: that process is gone "
                      "(killed before it could release the lock)")
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
                  "command": " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:500]}
        f.seek(0)
        f.truncate()
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
        self._file = f
        return self

    def release(self) -> None:
        """Clear the record and unlock (idempotent)."""
        if self._file is None:
            return
        try:
            self._file.seek(0)
            self._file.truncate()
            self._file.flush()
        except OSError:
            pass
        fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
        self._file.close()
        self._file = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class Locks:
    """The locks one run holds (its run directory, its checkpoint directory); released together."""

    def __init__(self, locks: list[RunLock]):
        self.locks = locks

    @property
    def held(self) -> bool:
        return any(lock.held for lock in self.locks)

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()


def _directories(run_dir, checkpoint_dir) -> list[tuple[Path, str]]:
    """(directory, setting) pairs to lock: the run directory, and the checkpoint directory unless
    it is the same directory (one lock file cannot be locked twice by one process)."""
    out = [(Path(run_dir), "job.output_dir")]
    if checkpoint_dir is not None and Path(checkpoint_dir).resolve() != Path(run_dir).resolve():
        out.append((Path(checkpoint_dir), "checkpoint.dir"))
    return out


def _acquire_all(run_dir, checkpoint_dir) -> Locks:
    held: list[RunLock] = []
    try:
        for directory, key in _directories(run_dir, checkpoint_dir):
            held.append(RunLock(directory, key=key).acquire())
    except BaseException:
        Locks(held).release()
        raise
    return Locks(held)


def hold_run_lock(run_dir: str | os.PathLike, rank: int, checkpoint_dir: str | os.PathLike | None = None
                  ) -> Optional[Locks]:
    """`agree_on_lock` over the current launch (`mrl.platform.dist.launch_store`)."""
    from mrl.platform.dist import launch_store, wait_timeout_s

    store, prefix = launch_store()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return agree_on_lock(run_dir, rank=rank, world_size=world, store=store, key_prefix=prefix,
                         timeout_s=wait_timeout_s(), checkpoint_dir=checkpoint_dir)


def agree_on_lock(run_dir: str | os.PathLike, *, rank: int, world_size: int, store=None, key_prefix: str = "mrl",
                  timeout_s: float = 600.0, checkpoint_dir: str | os.PathLike | None = None) -> Optional[Locks]:
    """Lock `run_dir` (and `checkpoint_dir`) on rank 0 and tell every rank the outcome through
    `store` (the launcher's key-value store; None in a one-process run). Returns rank 0's held
    locks (None elsewhere); raises the same `UserError` on every rank when a directory is in use."""
    if world_size <= 1 or store is None:
        return _acquire_all(run_dir, checkpoint_dir) if rank == 0 else None
    key = f"{key_prefix}/run_lock/{Path(run_dir).resolve()}"
    if rank == 0:
        try:
            locks = _acquire_all(run_dir, checkpoint_dir)
        except UserError as e:
            store.set(key, "error:" + e.problems[0])
            raise
        store.set(key, "ok")
        return locks
    import datetime as _dt

    store.wait([key], _dt.timedelta(seconds=timeout_s))
    outcome = store.get(key).decode()
    if outcome.startswith("error:"):
        raise UserError(outcome[len("error:"):])
    return None
