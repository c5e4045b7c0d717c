"""Least privilege for reward workers: what a user's reward function can see, reach and leave behind.

- **Environment allowlist.** A worker process starts with only the variables `worker_env` keeps:
  `ENV_ALLOW` (paths, locale, Python, thread counts, Hugging Face cache/offline switches) plus
  `reward.env_allow` (names or shell patterns). Everything else (`*_TOKEN`, `*_KEY`,
  `*_SECRET*`, `MLFLOW_*`, `WANDB_*`, `HF_TOKEN`, `AWS_*`, ...) never reaches it: the worker is
  exec'd with the filtered environment (`CleanEnvProcess`), so not even `/proc/self/environ`
  holds the trainer's secrets.
- **Own session, whole tree killed.** Workers start in their own session (and process group)
  and are child subreapers (PR_SET_CHILD_SUBREAPER): a daemon a reward starts (double fork,
  `setsid`) stays a descendant of its worker, and `kill_tree` freezes and kills every
  descendant with the worker, so nothing a reward started outlives the pool.
- **No writes into the run.** `deny_writes(paths)` uses Landlock (Linux >= 5.13, when the
  kernel has it enabled) to make the run and checkpoint directories unwritable from the
  worker: every other place stays writable except for creating new entries directly in the
  ancestors of those directories. Where Landlock is missing (older kernels, other systems, a
  kernel or container without it) nothing is enforced and the pool says so once.
"""
from __future__ import annotations

import ctypes
import fnmatch
import io
import os
import signal
import subprocess
import time
from multiprocessing import context, popen_spawn_posix, reduction, spawn, util
from pathlib import Path
from typing import Iterable, Mapping, Optional

__all__ = ["ENV_ALLOW", "worker_env", "CleanEnvProcess", "become_subreaper", "kill_tree", "deny_writes"]

# Kept from the trainer's environment for every reward worker (shell patterns).
ENV_ALLOW = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "PWD", "LANG", "LANGUAGE", "LC_*", "TZ",
             "TMPDIR", "TEMP", "TMP", "PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE",
             "PYTHONIOENCODING", "VIRTUAL_ENV", "CONDA_PREFIX", "LD_LIBRARY_PATH", "OMP_NUM_THREADS",
             "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM", "HF_HOME", "HF_HUB_CACHE",
             "HF_DATASETS_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "XDG_CACHE_HOME",
             "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE")


def worker_env(extra_allow: Iterable[str] = (), environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The environment a reward worker starts with: the variables of `environ` (default: this
    process's) matching `ENV_ALLOW` or one of `extra_allow` (`reward.env_allow`)."""
    environ = os.environ if environ is None else environ
    patterns = (*ENV_ALLOW, *extra_allow)
    return {k: v for k, v in environ.items() if any(fnmatch.fnmatchcase(k, p) for p in patterns)}


class _CleanEnvPopen(popen_spawn_posix.Popen):
    """multiprocessing's spawn launcher, exec'ing the child with `process_obj.env` in a new
    session (the standard launcher passes the parent's whole environment)."""

    def _launch(self, process_obj):
        from multiprocessing import resource_tracker

        tracker_fd = resource_tracker.getfd()
        self._fds.append(tracker_fd)
        prep_data = spawn.get_preparation_data(process_obj._name)
        fp = io.BytesIO()
        context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, fp)
            reduction.dump(process_obj, fp)
        finally:
            context.set_spawning_popen(None)
        parent_r = child_w = child_r = parent_w = None
        try:
            parent_r, child_w = os.pipe()
            child_r, parent_w = os.pipe()
            cmd = spawn.get_command_line(tracker_fd=tracker_fd, pipe_handle=child_r)
            self._fds.extend([child_r, child_w])
            self._proc = subprocess.Popen(cmd, executable=spawn.get_executable(), pass_fds=sorted(set(self._fds)),
                                          env=process_obj.env, close_fds=True, start_new_session=True)
            self.pid = self._proc.pid
            self.sentinel = parent_r
            with open(parent_w, "wb", closefd=False) as f:
                f.write(fp.getbuffer())
        finally:
            self.finalizer = util.Finalize(self, util.close_fds, [fd for fd in (parent_r, parent_w) if fd is not None])
            for fd in (child_r, child_w):
                if fd is not None:
                    os.close(fd)

    def poll(self, flag=os.WNOHANG):
        code = super().poll(flag)
        if code is not None:
            self._proc.returncode = code   # reaped here: subprocess must not wait for it again
        return code


class CleanEnvProcess(context.SpawnProcess):
    """A "spawn" process started with only the environment `env` (set before `start()`)."""

    env: dict[str, str] = {}

    @staticmethod
    def _Popen(process_obj):
        return _CleanEnvPopen(process_obj)


# ----------------------------------------------------------------------------- process tree

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphaned descendants of this process are re-parented to it instead of init (Linux)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process /proc lists."""
    out = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()   # after "pid (comm) "
        out[int(entry)] = int(fields[1])
    return out


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal(pids: Iterable[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_tree(pid: int) -> None:
    """SIGKILL `pid`, its process group and every descendant. The worker and its descendants are
    stopped first (until no new one appears), so none forks away while the tree is read; the
    worker being a subreaper keeps double-forked daemons in the tree."""
    _signal([pid], signal.SIGSTOP)
    stopped: set[int] = set()
    for _ in range(20):
        fresh = [p for p in descendants(pid) if p not in stopped]
        if not fresh:
            break
        _signal(fresh, signal.SIGSTOP)
        stopped.update(fresh)
        time.sleep(0.001)
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    _signal([*stopped, *descendants(pid), pid], signal.SIGKILL)


# ----------------------------------------------------------------------------- Landlock

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446   # the same on x86_64 and arm64
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
_WRITE_FILE, _REMOVE_DIR, _REMOVE_FILE = 1 << 1, 1 << 4, 1 << 5
_MAKE = sum(1 << b for b in range(6, 13))            # char, dir, reg, sock, fifo, block, sym
_REFER, _TRUNCATE = 1 << 13, 1 << 14                 # ABI 2, ABI 3


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _landlock_abi(libc) -> int:
    return libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))


def deny_writes(paths: Iterable[str | os.PathLike]) -> Optional[str]:
    """Make `paths` (directories) unwritable from this process and its future children, for
    good (Landlock). Returns None when enforced, else why not (one short sentence)."""
    targets = sorted({Path(p).resolve() for p in paths if p})
    if not targets:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        abi = _landlock_abi(libc)
    except (OSError, AttributeError):
        return "Landlock is not available on this system"
    if abi < 1:
        return f"Landlock is not enabled in this kernel ({os.strerror(ctypes.get_errno())})"
    handled = _WRITE_FILE | _REMOVE_DIR | _REMOVE_FILE | _MAKE | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0)
    file_rights = _WRITE_FILE | (_TRUNCATE if abi >= 3 else 0)
    attr = ctypes.c_uint64(handled)   # struct landlock_ruleset_attr's first field (ABI 1 size)
    ruleset = libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(8), ctypes.c_uint32(0))
    if ruleset < 0:
        return f"Landlock refused a ruleset ({os.strerror(ctypes.get_errno())})"
    try:
        for entry, rights in _allowed(targets, handled, file_rights):
            try:
                fd = os.open(entry, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                rule = _PathBeneath(rights, fd)
                libc.syscall(_SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0))
            finally:
                os.close(fd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or libc.syscall(_SYS_RESTRICT_SELF, ruleset, 0) != 0:
            return f"Landlock could not restrict the worker ({os.strerror(ctypes.get_errno())})"
    finally:
        os.close(ruleset)
    return None


def _allowed(targets: list[Path], dir_rights: int, file_rights: int):
    """(path, rights) granting writes everywhere except inside `targets`: every sibling of each
    directory on the way from / down to a target is allowed whole; the targets and their
    ancestors themselves are not (so no new entry appears in an ancestor either)."""
    on_path = {a for t in targets for a in (t, *t.parents)}
    seen = set()
    for t in targets:
        for parent in reversed(t.parents):
            if parent in seen:
                continue
            seen.add(parent)
            try:
                entries = list(parent.iterdir())
            except OSError:
                continue
            for e in entries:
                if e in on_path:
                    continue
                try:
                    if e.is_symlink():   # a link may lead into a target: it grants nothing
                        continue
                    is_dir = e.is_dir()
                except OSError:
                    continue
                yield e, (dir_rights if is_dir else file_rights)
