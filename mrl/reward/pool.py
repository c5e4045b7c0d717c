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

Least privilege (`mrl.reward.sandbox`): a worker starts with an allowlisted environment (no
tokens, keys, secrets or tracking credentials unless `reward.env_allow` names them), in its own
session, as a subreaper whose whole process tree (double-forked daemons included) is killed with
it, with the run and checkpoint directories unwritable where Landlock exists, and with a private
`TMPDIR`. Results come back as plain data: the worker turns a return value into JSON (numbers,
strings, lists, dicts; any other object becomes its description) and the trainer decodes JSON of
at most `MAX_REPLY_BYTES`, so nothing a reward returns is unpickled in the trainer.

`run(calls)` also bounds the whole batch: `batch_budget_s(len(calls))` is the time it can take
when every call runs up to its timeout; calls still unfinished past it get "timeout" outcomes.
So a peer rank waiting for this batch can wait in a stage whose timeout covers that budget.
"""
from __future__ import annotations

import fcntl
import json
import logging
import math
import multiprocessing as mp
import numbers
import os
import shutil
import signal
import sys
import tempfile
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
from mrl.reward import sandbox

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0  # a worker that cannot import its functions in this long is a broken set-up
_THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")  # one call, one thread
MAX_REPLY_BYTES = 16 << 20   # a worker's reply beyond this is an error, not decoded
_PLAIN_DEPTH = 32


def plain(value: Any, depth: int = 0) -> Any:
    """`value` as JSON-ready plain data: numbers (numpy and torch scalars and subclasses become
    int/float), strings, None, lists and dicts with string keys. Any other object becomes a
    short description string (a score that is one is "not_a_number"); nesting deeper than
    `_PLAIN_DEPTH` is a `ValueError`. Runs in the worker, inside the call's timeout."""
    if depth > _PLAIN_DEPTH:
        raise ValueError(f"nested deeper than {_PLAIN_DEPTH} levels")
    if value is None or type(value) in (bool, str):
        return value
    if getattr(value, "shape", None) == () and hasattr(value, "item"):   # 0-d numpy / torch
        value = value.item()
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, dict):
        return {str(k): plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, depth + 1) for v in value]
    return f"<{type(value).__name__}>"


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
    ran out of `memory_mb`), "unpicklable" (the value could not be sent back as plain JSON data). `output_dropped`:
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


def _send(conn, message) -> None:
    conn.send_bytes(json.dumps(message, allow_nan=True).encode())


def _worker_main(conn, refs: tuple[str, ...], memory_mb: int = 0, max_output_bytes: int | None = None,
                 env: dict | None = None, protect: tuple[str, ...] = ()) -> None:
    """Worker process: drop privileges (environment, writable directories), apply the limits,
    import the functions, report ready, then serve calls until the pipe closes."""
    if os.getsid(0) != os.getpid():
        os.setpgrp()  # own process group (spawned workers lead their own session already)
    die_with_parent()
    sandbox.become_subreaper()   # a reward's double-forked daemon stays in this tree (killed with it)
    if env is not None:          # spawned workers start with it; a forked one drops the rest here
        os.environ.clear()
        os.environ.update(env)
    if protect:   # Landlock forbids mounts from here on: the code sandbox's launcher is forked first
        from mrl.reward import sandbox_launcher

        sandbox_launcher.start()
    unenforced = sandbox.deny_writes(protect)
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
        _send(conn, ("setup_error", f"importing them needs more than reward.memory_mb = {memory_mb} MiB"))
        return
    except BaseException as e:  # noqa: BLE001 - reported to the parent as a set-up error
        where = ""
        tb = traceback.extract_tb(e.__traceback__)
        if tb:
            where = f" ({os.path.basename(tb[-1].filename)}:{tb[-1].lineno})"
        _send(conn, ("setup_error", f"{type(e).__name__}: {e}{where}"))
        return
    _send(conn, ("ready", unenforced))
    while True:
        try:
            task_id, ref, args, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        if cap is not None:
            cap.start_call()
        try:
            value = functions[ref](*args, **kwargs)
            try:
                reply = [task_id, None, plain(value), 0]
            except Exception as e:  # noqa: BLE001 - nested too deep, or a number whose conversion raises
                reply = [task_id, "unpicklable", f"returned a {type(value).__name__} that cannot be sent back as "
                                                 f"plain data: {type(e).__name__}: {str(e)[:160]}", 0]
        except MemoryError:
            reply = [task_id, "memory", f"MemoryError: the call needed more than reward.memory_mb = {memory_mb} MiB", 0]
        except Exception as e:  # noqa: BLE001 - any user error becomes an outcome
            tb = traceback.extract_tb(e.__traceback__)[-1]
            reply = [task_id, "exception", f"{type(e).__name__}: {e} ({os.path.basename(tb.filename)}:{tb.lineno})", 0]
        if cap is not None:
            reply[3] = cap.drain()
        try:
            data = json.dumps(reply, allow_nan=True).encode()
            if len(data) > MAX_REPLY_BYTES:
                raise ValueError(f"{len(data)} bytes of JSON, more than {MAX_REPLY_BYTES}")
        except (ValueError, TypeError, RecursionError) as e:   # e.g. an int of more than 4300 digits
            data = json.dumps([task_id, "unpicklable", f"returned a {type(reply[2]).__name__} that cannot be sent "
                                                       f"back as plain data: {str(e)[:160]}", reply[3]]).encode()
        conn.send_bytes(data)


def batch_budget_s(calls: int, workers: int, timeout_s: float, ready_timeout_s: float = READY_TIMEOUT_S) -> float:
    """The longest a batch of `calls` calls on `workers` workers takes: the workers starting up,
    then every wave of calls running up to `timeout_s` (plus a second per wave for replacing a
    killed worker and passing results)."""
    waves = math.ceil(calls / max(workers, 1))
    return ready_timeout_s + waves * (timeout_s + 1.0)


class _Worker:
    def __init__(self, ctx, refs: tuple[str, ...], limits: tuple, env: dict, protect: tuple[str, ...]):
        self.conn, child = ctx.Pipe(duplex=True)
        args = (child, refs, *limits, env, protect)
        if ctx.get_start_method() == "spawn":   # exec'd with `env` only: the trainer's secrets never reach it
            self.process = sandbox.CleanEnvProcess(target=_worker_main, args=args, daemon=True, name="mrl-reward")
            self.process.env = env
        else:
            self.process = ctx.Process(target=_worker_main, args=args, daemon=True, name="mrl-reward")
        self.process.start()
        child.close()
        self.ready = False
        self.born = time.monotonic()
        self.task: int | None = None
        self.started = 0.0

    def kill(self) -> None:
        """Kill the worker with everything it started (its group, and daemons that left it)."""
        pid = self.process.pid
        if pid is not None and self.process.exitcode is None:   # not reaped yet: the pid is still its own
            sandbox.kill_tree(pid)
        elif pid is not None:   # it died by itself: what is left of its group
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.process.join(timeout=5)
        self.conn.close()

    def receive(self) -> tuple:
        """The next message, decoded from JSON (never unpickled); `EOFError` past `MAX_REPLY_BYTES`."""
        try:
            return tuple(json.loads(self.conn.recv_bytes(MAX_REPLY_BYTES)))
        except (OSError, ValueError) as e:   # too long, or not JSON: the call fails as a crash
            sandbox.kill_tree(self.process.pid)
            self.process.join(timeout=5)
            raise EOFError(f"unreadable reply ({e})") from None


class RewardPool:
    """`workers` processes running reward calls with a `timeout_s` limit per call.

    Use as a context manager or call `close()`. `run(calls)` returns one `Outcome` per call, in
    order; it never raises for a user function's failure (a function that cannot even be imported
    is a `UserError`). `replacements` counts killed or dead workers that were replaced, and
    `truncated_calls` calls whose output went past `max_output_bytes` (for logging).
    """

    def __init__(self, refs: list[str] | tuple[str, ...], *, workers: int = 4, timeout_s: float = 30.0,
                 start_method: str = "spawn", memory_mb: int = 0, max_output_bytes: int | None = None,
                 ready_timeout_s: float = READY_TIMEOUT_S, env_allow: tuple[str, ...] = (),
                 protect_dirs: tuple[str, ...] = ()):
        self.refs = tuple(dict.fromkeys(refs))
        self.timeout_s = timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.replacements = 0
        self.truncated_calls = 0
        self.memory_mb, self.max_output_bytes = memory_mb, max_output_bytes
        self._limits = (memory_mb, max_output_bytes)
        self._ctx = mp.get_context(start_method)
        self._tmp = tempfile.mkdtemp(prefix="mrl-reward-")   # the workers' TMPDIR (writable under Landlock)
        self._env = sandbox.worker_env(env_allow) | {"TMPDIR": self._tmp, "TEMP": self._tmp, "TMP": self._tmp}
        self._protect = tuple(str(p) for p in protect_dirs if p)
        self.unprotected: str | None = None   # why the protected directories are writable after all
        self._workers = [self._new_worker() for _ in range(workers)]

    def _new_worker(self) -> _Worker:
        return _Worker(self._ctx, self.refs, self._limits, self._env, self._protect)

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
        shutil.rmtree(self._tmp, ignore_errors=True)

    def _replace(self, w: _Worker) -> _Worker:
        w.kill()
        self.replacements += 1
        fresh = self._new_worker()
        self._workers[self._workers.index(w)] = fresh
        return fresh

    def _on_message(self, w: _Worker, message: tuple, results: list, now: float) -> None:
        if not w.ready:
            kind, detail = message
            if kind == "setup_error":
                self.close()
                raise UserError(f"{self._what()} cannot be loaded: {detail}")
            w.ready = True
            if detail and self.unprotected is None and self._protect:
                self.unprotected = detail
                log.warning("reward workers can write into the run and checkpoint directories: %s", detail)
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
                        self._on_message(w, w.receive(), results, now)
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
