"""Process lifetimes and what a process shows of itself: helpers die with the process that started
them, ranks die with their launcher, and the trainer's secrets are not readable by its children.

- `die_with_parent()`: a helper (reward worker, megatron's checkpoint-writer manager) asks Linux
  to SIGKILL it when its parent dies (PR_SET_PDEATHSIG). A trainer killed outright (SIGKILL, the
  out-of-memory killer) runs no cleanup, so every helper must end by itself.
- `die_with_launcher()`: a rank started by torchrun (or `mrl launch`, which is torchrun's agent
  in-process) gets SIGTERM when its launcher dies (it unwinds as on any SIGTERM: the MLflow run
  ends KILLED), and a watcher thread SIGKILLs it `grace_s` later if it is still alive (a rank
  stuck in a collective never returns to Python to handle the SIGTERM). A rank whose launcher
  died before it could ask exits at once. Without it, `mrl launch` killed with SIGKILL left
  every rank training.
- `protect_secrets()`: the trainer holds HF_TOKEN, AWS_*, WANDB_API_KEY, MLFLOW_TRACKING_TOKEN in
  its environment, and a reward worker or an MCP stdio server (whose own environment is
  filtered) could read them from `/proc/<trainer pid>/environ`. The process makes itself
  non-dumpable (PR_SET_DUMPABLE 0: its /proc files belong to root and ptrace-type access needs
  CAP_SYS_PTRACE, so a child running as the same non-root user gets EACCES) and blanks the
  environment block the kernel shows there (the variables move to the C heap first, so
  `getenv` and `os.environ` keep working); the blanking is what stops a child running as root,
  which passes the permission check on some kernels. Side effects: no core dumps of the
  trainer, and debuggers or `py-spy` need root (CAP_SYS_PTRACE) to attach to it;
  `/proc/<pid>/environ` of the trainer reads as NUL bytes.

Standard library only: spawned helpers import it first.
"""
from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
LAUNCHER_PID = "MRL_LAUNCHER_PID"   # set by `mrl launch` for its ranks: the pid they must outlive only with


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux; elsewhere a no-op). Call it first thing
    in a helper process."""
    parent = os.getppid()
    libc = _libc()
    try:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except AttributeError:
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)


def under_launcher() -> bool:
    """Whether this process is a rank a torchrun agent started (torchrun or `mrl launch`); a
    process a rank started (`python -m mrl merge` for the export) inherits the launcher's
    variables but finds `MRL_LAUNCHER_PID` = "0", which the rank set for its children."""
    if os.environ.get(LAUNCHER_PID) == "0":
        return False
    return "TORCHELASTIC_RUN_ID" in os.environ or LAUNCHER_PID in os.environ


def die_with_launcher(grace_s: float = 20.0) -> bool:
    """Under torchrun: SIGTERM this rank when its launcher (the parent) dies, then SIGKILL it
    `grace_s` later; exit now (143) if the launcher is already gone. Returns whether it armed
    (False when not under a launcher, or off Linux)."""
    if not under_launcher():
        return False
    parent = os.getppid()
    libc = _libc()
    try:
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            return False
    except AttributeError:
        return False
    expected = os.environ.get(LAUNCHER_PID)
    os.environ[LAUNCHER_PID] = "0"   # what this rank starts is not a rank
    if os.getppid() != parent or parent == 1 or (expected and expected.isdigit() and int(expected) != parent):
        os._exit(128 + signal.SIGTERM)   # the launcher died before prctl took effect: we were reparented
    try:
        pidfd = os.pidfd_open(parent)
    except (OSError, AttributeError):
        return True   # the SIGTERM is armed; no bounded wait without pidfds
    if os.getppid() != parent:   # the parent died (and its pid may be reused) before the pidfd was opened
        os._exit(128 + signal.SIGTERM)
    threading.Thread(target=_kill_after_parent, args=(pidfd, grace_s), name="mrl-launcher-watch", daemon=True).start()
    return True


def _kill_after_parent(pidfd: int, grace_s: float) -> None:
    import select

    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    while not poller.poll():
        pass
    time.sleep(grace_s)   # the SIGTERM of PR_SET_PDEATHSIG had that long to unwind the rank
    os.kill(os.getpid(), signal.SIGKILL)


def protect_secrets() -> list[str]:
    """Make this process non-dumpable and blank the environment block `/proc/<pid>/environ`
    shows (see the module docstring). Linux only; returns what it could not do (empty when both
    took effect). Call it before starting any worker or server."""
    libc = _libc()
    if libc is None or not hasattr(libc, "prctl"):
        return ["no libc prctl on this system"]
    missing = []
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        missing.append(f"PR_SET_DUMPABLE: {os.strerror(ctypes.get_errno())}")
    problem = _blank_environ_block(libc)
    if problem:
        missing.append(problem)
    return missing


def boot() -> list[str]:
    """What `python -m mrl` does before anything else: a rank ties its life to its launcher's
    (`die_with_launcher`), and the process protects its secrets (`protect_secrets`) before it
    can start any worker or server. Returns what `protect_secrets` could not do."""
    die_with_launcher()
    return protect_secrets()


def _environ_range() -> tuple[int, int]:
    """(env_start, env_end) of this process: fields 50 and 51 of /proc/self/stat."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[50 - 3]), int(fields[51 - 3])


def _blank_environ_block(libc) -> str | None:
    """Copy every variable of the initial environment block to the heap (`setenv`, so libc's
    `environ` no longer points into the block), then zero the block."""
    try:
        start, end = _environ_range()
    except (OSError, IndexError, ValueError) as e:
        return f"environment block not found ({e})"
    if end <= start:
        return None
    block = ctypes.string_at(start, end - start)
    libc.setenv.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int]
    libc.getenv.argtypes = [ctypes.c_char_p]
    libc.getenv.restype = ctypes.c_void_p
    for entry in block.split(b"\0"):
        name, eq, value = entry.partition(b"=")
        if not eq or not name:
            continue
        where = libc.getenv(name)
        if where is not None and start <= where < end and libc.setenv(name, value, 1) != 0:
            return f"setenv {name.decode(errors='replace')}: {os.strerror(ctypes.get_errno())}"
    for entry in block.split(b"\0"):   # nothing libc reads may point into the block any more
        name = entry.partition(b"=")[0]
        where = libc.getenv(name) if name else None
        if where is not None and start <= where < end:
            return f"{name.decode(errors='replace')} still points into the environment block"
    ctypes.memset(start, 0, end - start)
    return None
