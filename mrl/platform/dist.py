"""Process-group set-up for SPMD launches, and collective timeouts that name the stage.

The launcher, rank, world and rendezvous come from `launch.py` (`detect_launch`).

Timeouts: the process group is created with `timeout=collective_timeout_s`, which gloo (and nccl
with async error handling) enforce per collective. `stage(name)` marks a region of the program
(e.g. "weight sync"); a backend timeout raised inside it becomes a `CollectiveTimeout` naming the
stage, and a watchdog thread ends a process whose stage outlives its deadline without the
backend noticing (a collective stuck in C++ cannot be interrupted from Python any other way).

Waiting on a peer's local work: when one rank does bounded work alone (the group leader generates
or scores rewards) the others would wait inside a collective that times out at
`collective_timeout_s`, however correct the slow work is. `create_wait_group(timeout_s)` makes a
gloo group over all ranks whose timeout covers that work's own bound, and `wait_for_peers(name)`
is a barrier on it: every rank arrives there, and only then do the (short) collectives that
exchange the results run.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import sys
import threading
import time
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from mrl.errors import CollectiveTimeout, UserError
from mrl.platform.launch import LaunchEnv

# Exit status of a process ended by the stage watchdog (distinct from 1 = bug, 2 = user error).
WATCHDOG_EXIT_CODE = 124


# --------------------------------------------------------------------------- process group

def init_process_group(launch: LaunchEnv, *, backend: str, device: torch.device,
                       collective_timeout_s: float, init_timeout_s: float,
                       role: Optional[str] = None, role_rank: Optional[int] = None,
                       role_world: Optional[int] = None) -> Optional[dist.Store]:
    """Create the default process group for `launch`.

    The group's timeout is `collective_timeout_s`; rendezvous waits at most `init_timeout_s`
    for all ranks. On nccl the group is bound to this rank's GPU up front. Each init in a
    process uses a fresh key prefix on the rendezvous store, so `teardown()` + `setup()` in one
    process works (a second plain `env://` init would read the first group's stale addresses).

    `role`: this rank's side of a split launch (`mrl.platform.bridge`): the default group is that
    side's world (`role_rank` of `role_world`), under the role's own prefix.
    Returns this init's prefixed store (None for a single process), on which the bridge's groups
    are built.
    """
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized; call mrl.platform.teardown() first")
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    kwargs = {}
    if backend == "nccl":
        kwargs["device_id"] = device
    job_store = None
    if launch.launcher == "single":
        store = dist.HashStore()
    else:
        job_store = dist.PrefixStore(f"mrl/pg{_STATE.generation}", _base_store(launch, init_timeout_s))
        store = dist.PrefixStore(role, job_store) if role else job_store
    _STATE.generation += 1
    rank = launch.rank if role_rank is None else role_rank
    world = launch.world_size if role_world is None else role_world
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)
    _STATE.default_timeout_s = collective_timeout_s
    _STATE.rank, _STATE.world_size = launch.rank, launch.world_size
    return job_store


def _base_store(launch: LaunchEnv, init_timeout_s: float) -> dist.Store:
    """The job's TCP rendezvous store, created once per process and reused by later inits.

    Under torchrun the elastic agent already hosts it at MASTER_ADDR:MASTER_PORT
    (TORCHELASTIC_USE_AGENT_STORE=True) and every rank is a client; otherwise (Slurm, or torchrun
    without an agent store) rank 0 hosts it and waits for the others. Every rank passes
    `wait_for_workers=True`: a client only counts as joined when it does.
    """
    key = (launch.master_addr, launch.master_port, launch.world_size)
    if _STATE.base_store is not None and _STATE.base_store_key == key:
        return _STATE.base_store
    if not launch.master_addr or launch.master_port is None:
        raise UserError(f"{launch.launcher} launch without MASTER_ADDR/MASTER_PORT: cannot rendezvous")
    agent = launch.launcher == "torchrun" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    host = not agent and launch.rank == 0
    try:
        store = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, is_master=host,
                              timeout=datetime.timedelta(seconds=init_timeout_s), wait_for_workers=True,
                              multi_tenant=True)
    except (dist.DistError, RuntimeError) as e:
        raise CollectiveTimeout(
            f"stage 'process-group init': rank {launch.rank}/{launch.world_size} could not rendezvous "
            f"at {launch.master_addr}:{launch.master_port} within {init_timeout_s:g} s ({_first_line(e)}). "
            "Are all ranks running? Inside an sbatch script, start ranks with `srun`."
        ) from e
    _STATE.base_store, _STATE.base_store_key = store, key
    return store


def launch_store() -> tuple[Optional[dist.Store], str]:
    """The launch's key-value store (None in a one-process run) and a key prefix unique to the
    current process-group generation, for agreements outside any collective (the run lock)."""
    return _STATE.base_store, f"mrl/pg{_STATE.generation}"


def destroy_process_group() -> None:
    """Tear down the default process group (idempotent)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _STATE.default_timeout_s = None
    _STATE.wait_group, _STATE.wait_timeout_s = None, None


def create_wait_group(timeout_s: float) -> None:
    """A gloo group over every rank with timeout `timeout_s`, for `wait_for_peers`. Collective:
    every rank calls it at the same point (before any rank starts long local work)."""
    _STATE.wait_timeout_s = float(timeout_s)
    if dist.is_initialized() and dist.get_world_size() > 1:
        with stage("wait-group init"):
            _STATE.wait_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def wait_timeout_s() -> float:
    """The wait group's timeout (the job's collective timeout when there is none)."""
    if _STATE.wait_timeout_s is not None:
        return _STATE.wait_timeout_s
    return _STATE.default_timeout_s if _STATE.default_timeout_s is not None else 1800.0


_EVERY_RANK = object()


@contextlib.contextmanager
def waits_within(group):
    """Within this block (this thread), `wait_for_peers` waits for the ranks of `group` only (None:
    for no other rank): work that a subset of the world runs while the other ranks wait elsewhere
    (one router's producer, `mrl.train.driver`). `group` should have the wait group's timeout."""
    before = getattr(_STATE.local, "wait_within", _EVERY_RANK)
    _STATE.local.wait_within = group
    try:
        yield
    finally:
        _STATE.local.wait_within = before


def wait_for_peers(name: str) -> None:
    """Barrier over every rank on the wait group (see the module docstring), as the stage `name`
    with the wait group's timeout. A no-op on one rank. Inside `waits_within(group)` the barrier
    is over `group` only."""
    within = getattr(_STATE.local, "wait_within", _EVERY_RANK)
    if within is not _EVERY_RANK:
        if within is not None and dist.get_world_size(within) > 1:
            with stage(name, wait_timeout_s(), backend_timeout_s=wait_timeout_s()):
                dist.barrier(group=within)
        return
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    if _STATE.wait_group is None:
        raise RuntimeError("wait_for_peers before create_wait_group")
    timeout = wait_timeout_s()
    with stage(name, timeout, backend_timeout_s=timeout):
        dist.barrier(group=_STATE.wait_group)


# --------------------------------------------------------------------------- stages and watchdog

class _State:
    def __init__(self):
        self.default_timeout_s: Optional[float] = None
        self.rank: int = 0
        self.world_size: int = 1
        self.generation: int = 0
        self.base_store: Optional[dist.Store] = None
        self.base_store_key: Optional[tuple] = None
        self.wait_group = None
        self.wait_timeout_s: Optional[float] = None
        self.local = threading.local()


_STATE = _State()

# Messages with which backends report a collective that ran out of time.
_TIMEOUT_MARKERS = ("timed out", "timeout", "deadline exceeded")


def current_stage() -> Optional[str]:
    """The innermost active `stage` of this thread, or None."""
    stack = getattr(_STATE.local, "stack", None)
    return stack[-1] if stack else None


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def _is_timeout(e: BaseException) -> bool:
    if isinstance(e, CollectiveTimeout):
        return False
    if not isinstance(e, (RuntimeError, dist.DistError)):
        return False
    msg = str(e).lower()
    return any(m in msg for m in _TIMEOUT_MARKERS)


@dataclasses.dataclass
class _Watch:
    stage: str
    timeout_s: float
    grace_s: float
    deadline: float        # start + timeout: warn, naming the stage
    kill_at: float         # deadline + grace: abort and exit
    warned: bool = False


class _Watchdog:
    """One daemon thread that watches every active stage's deadline.

    At `timeout_s` it prints which stage on which rank overran (so the log names the stage even
    if the backend then kills the process: nccl's own watchdog tears a rank down on timeout).
    The backend's timeout normally fires at about the same time (gloo raises, which `stage` turns
    into `CollectiveTimeout`). The backstop, for a collective stuck where no timeout applies: at
    `timeout_s + grace_s` it tries to abort the process group so blocked calls return, waits
    `grace_s` more, and exits with `WATCHDOG_EXIT_CODE` so the launcher tears the job down
    instead of it hanging forever.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._active: dict[int, _Watch] = {}
        self._next = 0
        self._thread: Optional[threading.Thread] = None
        self._wake = threading.Event()

    def register(self, name: str, timeout_s: float, grace_s: float) -> int:
        now = time.monotonic()
        with self._lock:
            token = self._next
            self._next += 1
            self._active[token] = _Watch(name, timeout_s, grace_s, now + timeout_s, now + timeout_s + grace_s)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="mrl-stage-watchdog", daemon=True)
                self._thread.start()
        self._wake.set()
        return token

    def unregister(self, token: int) -> None:
        with self._lock:
            self._active.pop(token, None)

    def _run(self) -> None:
        while True:
            self._wake.clear()
            with self._lock:
                now = time.monotonic()
                watches = list(self._active.values())
            for w in watches:
                if now >= w.kill_at:
                    self._fire(w)
                    return
                if now >= w.deadline and not w.warned:
                    w.warned = True
                    print(f"mrl: rank {_STATE.rank}/{_STATE.world_size}: stage '{w.stage}' has run past its "
                          f"{w.timeout_s:g} s collective timeout", file=sys.stderr, flush=True)
            pending = [w.kill_at if w.warned else w.deadline for w in watches]
            self._wake.wait(timeout=max(0.05, min(pending) - now) if pending else None)

    def _fire(self, w: _Watch) -> None:
        print(f"mrl: rank {_STATE.rank}/{_STATE.world_size}: collective in stage '{w.stage}' did not finish "
              f"within {w.timeout_s:g} s and the backend did not time it out; aborting the process",
              file=sys.stderr, flush=True)
        # Abort on a helper thread (it can block too); nccl's blocked collectives then return an error.
        threading.Thread(target=_try_abort, name="mrl-pg-abort", daemon=True).start()
        time.sleep(w.grace_s)
        os._exit(WATCHDOG_EXIT_CODE)


def _try_abort() -> None:
    try:
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None and dist.is_initialized():
            abort()
    except Exception:  # noqa: BLE001 - best effort before the hard exit
        pass


_WATCHDOG = _Watchdog()


def _grace(timeout_s: float) -> float:
    return max(5.0, 0.1 * timeout_s)


@contextlib.contextmanager
def stage(name: str, timeout_s: Optional[float] = None, *, watchdog: bool = True,
          grace_s: Optional[float] = None, backend_timeout_s: Optional[float] = None) -> Iterator[None]:
    """Mark a region whose collectives must finish within `timeout_s` (default: the job's
    `collective_timeout_s`, which is also the process group's timeout: a longer `timeout_s`
    cannot extend what the backend enforces, a shorter one arms the watchdog earlier).

    A backend timeout raised inside becomes `CollectiveTimeout("collective in stage 'NAME' did not
    finish within T s ...")`; other distributed errors get a note naming the stage. With
    `watchdog`, a stage still running `timeout_s` + `grace_s` (default max(5 s, 10 %)) after it
    started ends the process (see `_Watchdog`). Stages nest; the innermost name is reported.
    A stage is per thread; the watchdog watches all threads' stages. `backend_timeout_s`: the
    timeout of the group the stage's collectives use, when it is not the default group's
    (`wait_for_peers`).
    """
    if timeout_s is None:
        timeout_s = _STATE.default_timeout_s if _STATE.default_timeout_s is not None else 1800.0
    stack = getattr(_STATE.local, "stack", None)
    if stack is None:
        stack = _STATE.local.stack = []
    stack.append(name)
    grace_s = _grace(timeout_s) if grace_s is None else grace_s
    token = _WATCHDOG.register(name, timeout_s, grace_s) if watchdog else None
    start = time.monotonic()
    try:
        yield
    except BaseException as e:
        elapsed = time.monotonic() - start
        backend = backend_timeout_s or _STATE.default_timeout_s or timeout_s
        limit = min(timeout_s, backend)  # the backend fires at its own timeout
        if _is_timeout(e) and elapsed >= 0.9 * limit:
            raise CollectiveTimeout(
                f"collective in stage '{name}' did not finish within {limit:g} s "
                f"(rank {_STATE.rank}/{_STATE.world_size}, {elapsed:.1f} s into the stage): "
                f"{_first_line(e)}. A peer rank is stuck, crashed or skipped the collective; "
                "its log names where."
            ) from e
        if isinstance(e, (RuntimeError, dist.DistError)) and not isinstance(e, CollectiveTimeout):
            e.add_note(f"mrl: raised in stage '{name}' on rank {_STATE.rank}/{_STATE.world_size}")
        raise
    finally:
        if token is not None:
            _WATCHDOG.unregister(token)
        stack.pop()
