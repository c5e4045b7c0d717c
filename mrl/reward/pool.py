"""Isolated reward calls: worker processes with a per-call timeout that kills a hung call.

`concurrent.futures.ProcessPoolExecutor` cannot cancel a running call, so one hung reward function
would block a worker (and the step) forever. Here each worker is a `multiprocessing` process with
its own pipe; the parent hands one call at a time to an idle worker and waits on all pipes with the
nearest deadline. A call past its deadline has its worker killed (its whole process group, so
subprocesses the user's code started die too) and replaced; a worker that dies mid-call is
replaced as well. Either way the call gets an error outcome and the batch goes on.

Workers import every function they will run before they report ready, so the timeout measures the
call alone, not imports. Workers are started with "spawn" by default: a forked copy of a trainer
process (CUDA, gloo threads) is not safe.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

from mrl.errors import UserError

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0  # a worker that cannot import its functions in this long is a broken set-up


@dataclass(frozen=True)
class Call:
    """One reward call: `function(*args, **kwargs)` where `function` is a `module:function` or `file.py:function` ref."""

    ref: str
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class Outcome:
    """What a call produced: `value` when `error` is None, else the error kind and a message.

    Kinds: "exception" (the function raised), "timeout" (killed after `timeout_s`), "crash" (the
    worker died, e.g. a segfault or `os._exit`), "unpicklable" (the value could not be sent back).
    """

    value: Any = None
    error: str | None = None
    message: str = ""
    seconds: float = 0.0


def _worker_main(conn, refs: tuple[str, ...]) -> None:
    """Worker process: import the functions, report ready, then serve calls until the pipe closes."""
    os.setpgrp()  # own process group: a kill on timeout also reaches the user's subprocesses
    from mrl.reward.function import load_function

    try:
        functions = {ref: load_function(ref) for ref in refs}
    except BaseException as e:  # noqa: BLE001 - reported to the parent as a set-up error
        conn.send(("setup_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            task_id, ref, args, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            value = functions[ref](*args, **kwargs)
            reply = (task_id, None, value)
        except Exception as e:  # noqa: BLE001 - any user error becomes an outcome
            tb = traceback.extract_tb(e.__traceback__)[-1]
            reply = (task_id, "exception", f"{type(e).__name__}: {e} ({os.path.basename(tb.filename)}:{tb.lineno})")
        try:
            conn.send(reply)
        except Exception as e:  # noqa: BLE001 - e.g. the value cannot be pickled
            conn.send((task_id, "unpicklable", f"returned a {type(reply[2]).__name__} that cannot be sent back: {e}"))


class _Worker:
    def __init__(self, ctx, refs: tuple[str, ...]):
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_worker_main, args=(child, refs), daemon=True, name="mrl-reward")
        self.process.start()
        child.close()
        self.ready = False
        self.task: int | None = None
        self.started = 0.0

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class RewardPool:
    """`workers` processes running reward calls with a `timeout_s` limit per call.

    Use as a context manager or call `close()`. `run(calls)` returns one `Outcome` per call, in
    order; it never raises for a user function's failure. `replacements` counts killed or dead
    workers that were replaced (for logging).
    """

    def __init__(self, refs: list[str] | tuple[str, ...], *, workers: int = 4, timeout_s: float = 30.0,
                 start_method: str = "spawn"):
        self.refs = tuple(dict.fromkeys(refs))
        self.timeout_s = timeout_s
        self.replacements = 0
        self._ctx = mp.get_context(start_method)
        self._workers = [_Worker(self._ctx, self.refs) for _ in range(workers)]

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for w in self._workers:
            w.kill()
        self._workers = []

    def _replace(self, w: _Worker) -> _Worker:
        w.kill()
        self.replacements += 1
        fresh = _Worker(self._ctx, self.refs)
        self._workers[self._workers.index(w)] = fresh
        return fresh

    def _on_message(self, w: _Worker, message: tuple, results: list, now: float) -> None:
        if not w.ready:
            kind, detail = message
            if kind == "setup_error":
                self.close()
                raise UserError(f"reward functions {', '.join(self.refs)} cannot be loaded: {detail}")
            w.ready = True
            return
        task_id, error, payload = message
        if task_id == w.task:
            seconds = now - w.started
            results[task_id] = (Outcome(value=payload, seconds=seconds) if error is None
                                else Outcome(error=error, message=payload, seconds=seconds))
            w.task = None

    def run(self, calls: list[Call]) -> list[Outcome]:
        """Run `calls` on the workers; every call gets an outcome (see `Outcome` for error kinds)."""
        if not self._workers:
            raise RuntimeError("RewardPool is closed")
        results: list[Outcome | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        set_up_since = time.monotonic()
        while pending or any(w.task is not None for w in self._workers):
            now = time.monotonic()
            for w in self._workers:
                if pending and w.ready and w.task is None:
                    task_id = pending.popleft()
                    call = calls[task_id]
                    w.task, w.started = task_id, time.monotonic()
                    w.conn.send((task_id, call.ref, call.args, call.kwargs))
            busy = [w for w in self._workers if w.task is not None]
            waiting = [w for w in self._workers if not w.ready]
            if not busy and waiting and now - set_up_since > READY_TIMEOUT_S:
                self.close()
                raise RuntimeError(f"reward workers did not start within {READY_TIMEOUT_S:.0f}s")
            deadline = min((w.started + self.timeout_s for w in busy), default=now + 1.0)
            watched = {w.conn: w for w in busy + waiting}
            watched.update({w.process.sentinel: w for w in busy + waiting})
            ready = wait(list(watched), timeout=max(0.0, deadline - time.monotonic()))
            now = time.monotonic()
            handled = set()
            for obj in ready:
                w = watched[obj]
                if id(w) in handled:
                    continue
                handled.add(id(w))
                try:
                    while w.conn.poll():
                        self._on_message(w, w.conn.recv(), results, now)
                except (EOFError, OSError):
                    pass
                if not w.process.is_alive() or obj is w.process.sentinel:
                    if w.task is not None:
                        results[w.task] = Outcome(error="crash", message=f"worker died (exit code {w.process.exitcode})",
                                                  seconds=now - w.started)
                        w.task = None
                    elif not w.ready:
                        self.close()
                        raise RuntimeError(f"reward worker exited during start-up (exit code {w.process.exitcode})")
                    self._replace(w)
            for w in list(self._workers):
                if w.task is not None and now - w.started >= self.timeout_s:
                    results[w.task] = Outcome(error="timeout", message=f"no result after {self.timeout_s:g}s; worker killed",
                                              seconds=now - w.started)
                    w.task = None
                    self._replace(w)
        return results  # type: ignore[return-value]
