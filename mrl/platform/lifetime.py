"""Helper processes die with the process that started them.

A trainer killed outright (SIGKILL, the out-of-memory killer, a launcher tearing a job down)
runs no cleanup, so every helper it started (reward workers, megatron's checkpoint-writer
manager) must end by itself: `die_with_parent()` asks Linux to SIGKILL the calling process when
its parent dies (PR_SET_PDEATHSIG). Standard library only: spawned helpers import it first.
"""
from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux; elsewhere a no-op). Call it first thing
    in a helper process."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)
