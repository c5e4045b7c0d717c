"""One run, one writer: an exclusive lock on the run directory for the life of a run.

Two launches of one job into one output directory would otherwise share its checkpoints and its
MLflow run: one deletes the other's save in progress (the stale-temp cleanup), both log rows for
the same steps. `RunLock` holds `flock(LOCK_EX)` on `<run dir>/.mrl.lock` from before the first
checkpoint or MLflow access to the run's end; the file records who holds it (pid, host, start
time, command), so the second launch fails in one line naming the holder.

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


class RunLock:
    """The lock of one run directory; `acquire()` raises `UserError` naming the holder."""

    def __init__(self, run_dir: str | os.PathLike, *, say: Callable[[str], None] | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._file = None
        self._say = say or log.warning
        self.took_over: Optional[dict] = None   # the record of a dead holder this lock replaced

    def acquire(self) -> "RunLock":
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            f = open(self.path, "a+")
        except OSError as e:
            raise UserError(f"job.output_dir: {self.run_dir} is not writable ({e.strerror})") from None
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_record(f)
            f.close()
            who = _holder_text(holder) if holder else "another process (it has not written its record yet)"
            raise UserError(f"job.output_dir: the run directory {self.run_dir} is in use by {who}; wait for that "
                            f"run to end, or give this one another job.name or job.output_dir") from None
        except OSError as e:   # a filesystem without locks: say so, run unlocked
            self._say(f"run lock: {self.path} cannot be locked on this filesystem ({e.strerror}); "
                      "nothing stops a second launch into this run directory")
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


def hold_run_lock(run_dir: str | os.PathLike, rank: int) -> Optional[RunLock]:
    """`agree_on_lock` over the current launch (`mrl.platform.dist.launch_store`)."""
    from mrl.platform.dist import launch_store, wait_timeout_s

    store, prefix = launch_store()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return agree_on_lock(run_dir, rank=rank, world_size=world, store=store, key_prefix=prefix,
                         timeout_s=wait_timeout_s())


def agree_on_lock(run_dir: str | os.PathLike, *, rank: int, world_size: int, store=None, key_prefix: str = "mrl",
                  timeout_s: float = 600.0) -> Optional[RunLock]:
    """Lock `run_dir` on rank 0 and tell every rank the outcome through `store` (the launcher's
    key-value store; None in a one-process run). Returns rank 0's held lock (None elsewhere);
    raises the same `UserError` on every rank when the directory is in use."""
    if world_size <= 1 or store is None:
        return RunLock(run_dir).acquire() if rank == 0 else None
    key = f"{key_prefix}/run_lock/{Path(run_dir).resolve()}"
    if rank == 0:
        try:
            lock = RunLock(run_dir).acquire()
        except UserError as e:
            store.set(key, "error:" + e.problems[0])
            raise
        store.set(key, "ok")
        return lock
    import datetime as _dt

    store.wait([key], _dt.timedelta(seconds=timeout_s))
    outcome = store.get(key).decode()
    if outcome.startswith("error:"):
        raise UserError(outcome[len("error:"):])
    return None
