"""Isolated reward calls: worker processes with a per-call timeout that kills a hung call.

`concurrent.futures.ProcessPoolExecutor` cannot cancel a running call, so one hung reward function
would block a worker (and the step) forever. Here each worker is a `multiprocessing` process with
its own pipe; the parent hands one call at a time to an idle worker and waits on all pipes with the
nearest deadline. A call past its deadline has its worker killed (its whole process group, so
subprocesses the user's code started die too) and replaced; a worker that dies mid-call is
replaced as well. Either way the call gets an error outcome and the batch goes on.

Workers import every function they will run before they report ready, so the timeout measures the
call alone, not imports; a worker that cannot import them (an exception, `sys.exit`, `os._exit`, a
crash, or no ready signal within `ready_timeout_s`) is a one-line `UserError`. Workers are started
with "spawn" by default: a forked copy of a trainer process (CUDA, gloo threads) is not safe.

Limits per worker: `memory_mb` of address space (RLIMIT_AS; a call that exceeds it fails as
"memory", or "crash" when the allocation happens outside Python) and `max_output_bytes` of
stdout/stderr per call (the user's prints and their subprocesses'; the rest is dropped and
counted in `truncated_calls`). Workers die with the process that started them (PR_SET_PDEATHSIG),
so a trainer killed outright leaves no reward processes behind.

`run(calls)` also bounds the whole batch: `batch_budget_s(len(calls))` is the time it can take
when every call runs up to its timeout; calls still unfinished past it get "timeout" outcomes.
So a peer rank waiting for this batch can wait in a stage whose timeout covers that budget.
"""
from __future__ import annotations

import fcntl
import logging
import math
import multiprocessing as mp
import os
import signal
import sys
import termios
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

from mrl.errors import UserError
from mrl.platform.lifetime import die_with_parent

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0  # a worker that cannot import its functions in this long is a broken set-up
_THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")  # one call, one thread


@dataclass(frozen=True)
class Call:
    """One reward call: `function(*args, **kwargs)` where `function` is a `module:function` or `file.py:function` ref."""

    ref: str
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class Outcome:
    """What a call produced: `value` when `error` is None, else the error kind and a message.

    Kinds: "exception" (the function raised), "timeout" (killed after `timeout_s`, or the batch's
    budget ran out), "crash" (the worker died, e.g. a segfault or `os._exit`), "memory" (the call
    ran out of `memory_mb`), "unpicklable" (the value could not be sent back). `output_dropped`:
    bytes of the call's output beyond `max_output_bytes`.
    """

    value: Any = None
    error: str | None = None
    message: str = ""
    seconds: float = 0.0
    output_dropped: int = 0


class _OutputCap:
    """fd 1 and 2 of this worker go through a pipe; a thread passes at most `limit` bytes per call
    on to the real stdout/stderr and counts the rest."""

    def __init__(self, limit: int):
        self.limit = limit
        self.out = os.dup(1)
        self.read_fd, w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(w, 1)
        os.dup2(w, 2)
        os.close(w)
        self.lock = threading.Lock()
        self.passed = self.dropped = 0
        self.busy = False
        threading.Thread(target=self._pump, name="mrl-reward-output", daemon=True).start()

    def _pump(self) -> None:
        while True:
            chunk = os.read(self.read_fd, 65536)
            if not chunk:
                return
            with self.lock:
                self.busy = True
                room = max(self.limit - self.passed, 0)
                keep = chunk[:room]
                self.passed += len(keep)
                self.dropped += len(chunk) - len(keep)
            try:
                if keep:
                    os.write(self.out, keep)
            except OSError:
                pass
            with self.lock:
                self.busy = False

    def start_call(self) -> None:
        self.drain()
        with self.lock:
            self.passed = self.dropped = 0

    def drain(self) -> int:
        """Flush Python's buffers, wait (briefly) until the pipe is empty; bytes dropped so far."""
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except (OSError, ValueError):
                pass
        buf = bytearray(4)
        deadline, quiet = time.monotonic() + 0.5, 0
        while time.monotonic() < deadline and quiet < 2:   # empty and idle twice in a row
            fcntl.ioctl(self.read_fd, termios.FIONREAD, buf)
            with self.lock:
                quiet = quiet + 1 if int.from_bytes(buf, sys.byteorder) == 0 and not self.busy else 0
            time.sleep(0.001)
        with self.lock:
            return self.dropped


def _worker_main(conn, refs: tuple[str, ...], memory_mb: int = 0, max_output_bytes: int | None = None) -> None:
    """Worker process: apply the limits, import the functions, report ready, then serve calls
    until the pipe closes."""
    os.setpgrp()  # own process group: a kill on timeout also reaches the user's subprocesses
    die_with_parent()
    for key in _THREAD_ENV:
        os.environ.setdefault(key, "1")
    if memory_mb:
        import resource

        limit = memory_mb << 20
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    cap = _OutputCap(max_output_bytes) if max_output_bytes is not None else None
    from mrl.reward.function import load_function

    try:
        functions = {ref: load_function(ref) for ref in refs}
    except MemoryError:
        conn.send(("setup_error", f"importing them needs more than reward.memory_mb = {memory_mb} MiB"))
        return
    except BaseException as e:  # noqa: BLE001 - reported to the parent as a set-up error
        where = ""
        tb = traceback.extract_tb(e.__traceback__)
        if tb:
            where = f" ({os.path.basename(tb[-1].filename)}:{tb[-1].lineno})"
        conn.send(("setup_error", f"{type(e).__name__}: {e}{where}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            task_id, ref, args, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        if cap is not None:
            cap.start_call()
        try:
            value = functions[ref](*args, **kwargs)
            reply = [task_id, None, value, 0]
        except MemoryError:
            reply = [task_id, "memory", f"MemoryError: the call needed more than reward.memory_mb = {memory_mb} MiB", 0]
        except Exception as e:  # noqa: BLE001 - any user error becomes an outcome
            tb = traceback.extract_tb(e.__traceback__)[-1]
            reply = [task_id, "exception", f"{type(e).__name__}: {e} ({os.path.basename(tb.filename)}:{tb.lineno})", 0]
        if cap is not None:
            reply[3] = cap.drain()
        try:
            conn.send(tuple(reply))
        except Exception as e:  # noqa: BLE001 - e.g. the value cannot be pickled
            conn.send((task_id, "unpicklable", f"returned a {type(reply[2]).__name__} that cannot be sent back: {e}",
                       reply[3]))


def batch_budget_s(calls: int, workers: int, timeout_s: float, ready_timeout_s: float = READY_TIMEOUT_S) -> float:
    """The longest a batch of `calls` calls on `workers` workers takes: the workers starting up,
    then every wave of calls running up to `timeout_s` (plus a second per wave for replacing a
    killed worker and passing results)."""
    waves = math.ceil(calls / max(workers, 1))
    return ready_timeout_s + waves * (timeout_s + 1.0)


class _Worker:
    def __init__(self, ctx, refs: tuple[str, ...], limits: tuple):
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_worker_main, args=(child, refs, *limits), daemon=True, name="mrl-reward")
        self.process.start()
        child.close()
        self.ready = False
        self.born = time.monotonic()
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
    order; it never raises for a user function's failure (a function that cannot even be imported
    is a `UserError`). `replacements` counts killed or dead workers that were replaced, and
    `truncated_calls` calls whose output went past `max_output_bytes` (for logging).
    """

    def __init__(self, refs: list[str] | tuple[str, ...], *, workers: int = 4, timeout_s: float = 30.0,
                 start_method: str = "spawn", memory_mb: int = 0, max_output_bytes: int | None = None,
                 ready_timeout_s: float = READY_TIMEOUT_S):
        self.refs = tuple(dict.fromkeys(refs))
        self.timeout_s = timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.replacements = 0
        self.truncated_calls = 0
        self.memory_mb, self.max_output_bytes = memory_mb, max_output_bytes
        self._limits = (memory_mb, max_output_bytes)
        self._ctx = mp.get_context(start_method)
        self._workers = [_Worker(self._ctx, self.refs, self._limits) for _ in range(workers)]

    @property
    def workers(self) -> int:
        return len(self._workers)

    def batch_budget_s(self, calls: int) -> float:
        """The longest `run` of `calls` calls takes (`batch_budget_s`)."""
        return batch_budget_s(calls, self.workers, self.timeout_s, self.ready_timeout_s)

    def _what(self) -> str:
        return f"reward function{'s' if len(self.refs) > 1 else ''} {', '.join(self.refs)}"

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
        fresh = _Worker(self._ctx, self.refs, self._limits)
        self._workers[self._workers.index(w)] = fresh
        return fresh

    def _on_message(self, w: _Worker, message: tuple, results: list, now: float) -> None:
        if not w.ready:
            kind, detail = message
            if kind == "setup_error":
                self.close()
                raise UserError(f"{self._what()} cannot be loaded: {detail}")
            w.ready = True
            return
        task_id, error, payload, dropped = message
        if task_id == w.task:
            seconds = now - w.started
            self.truncated_calls += dropped > 0
            results[task_id] = (Outcome(value=payload, seconds=seconds, output_dropped=dropped) if error is None
                                else Outcome(error=error, message=payload, seconds=seconds, output_dropped=dropped))
            w.task = None

    def run(self, calls: list[Call]) -> list[Outcome]:
        """Run `calls` on the workers; every call gets an outcome (see `Outcome` for error kinds)."""
        if not self._workers:
            raise RuntimeError("RewardPool is closed")
        results: list[Outcome | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        budget_end = time.monotonic() + self.batch_budget_s(len(calls))
        while pending or any(w.task is not None for w in self._workers):
            now = time.monotonic()
            if now > budget_end:
                self._out_of_budget(pending, results, now)
                break
            for w in self._workers:
                if pending and w.ready and w.task is None:
                    task_id = pending.popleft()
                    call = calls[task_id]
                    w.task, w.started = task_id, time.monotonic()
                    w.conn.send((task_id, call.ref, call.args, call.kwargs))
            busy = [w for w in self._workers if w.task is not None]
            waiting = [w for w in self._workers if not w.ready]
            slow = [w for w in waiting if now - w.born > self.ready_timeout_s]
            if slow and all(not w.ready for w in self._workers):
                self.close()
                raise UserError(f"{self._what()}: the reward workers did not finish importing them within "
                                f"{self.ready_timeout_s:g} s (a slow or hanging import)")
            for w in slow:   # others are serving: replace the stuck one
                self._replace(w)
            if slow:
                waiting = [w for w in self._workers if not w.ready]
            deadline = min([w.started + self.timeout_s for w in busy] + [w.born + self.ready_timeout_s for w in waiting]
                           + [budget_end], default=now + 1.0)
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
                    w.process.join(timeout=5)   # reaped: its exit code is known
                    if w.task is not None:
                        results[w.task] = Outcome(error="crash", message=f"worker died (exit code {w.process.exitcode})",
                                                  seconds=now - w.started)
                        w.task = None
                    elif not w.ready:
                        code = w.process.exitcode
                        self.close()
                        raise UserError(f"{self._what()}: the reward worker exited with code {code} while importing "
                                        "them (os._exit, sys.exit or a crash at import time)")
                    self._replace(w)
            for w in list(self._workers):
                if w.task is not None and now - w.started >= self.timeout_s:
                    results[w.task] = Outcome(error="timeout", message=f"no result after {self.timeout_s:g}s; worker killed",
                                              seconds=now - w.started)
                    w.task = None
                    self._replace(w)
        return results  # type: ignore[return-value]

    def _out_of_budget(self, pending: deque, results: list, now: float) -> None:
        """The batch ran past `batch_budget_s`: unfinished calls time out, busy workers are replaced."""
        message = f"the batch ran past its {self.batch_budget_s(len(results)):g} s budget (workers slow to start?)"
        for w in list(self._workers):
            if w.task is not None:
                results[w.task] = Outcome(error="timeout", message=message, seconds=now - w.started)
                w.task = None
                self._replace(w)
        while pending:
            results[pending.popleft()] = Outcome(error="timeout", message=message)
