"""Run one untrusted Python program in a sandbox: namespaces, a fresh uid, rlimits, a wall timeout.

`run_sandboxed(argv_files, stdin, limits)` starts, in order of what this machine allows:

- **namespaces** (root, `unshare` from util-linux): new network, mount and PID namespaces
  (`unshare --net --mount --pid --fork --kill-child --mount-proc`). Inside, `code_sandbox_boot.py`
  builds a fresh root of the system's read-only directories and the interpreter (no run
  directory, no data, no host /tmp, /run or home, so no host unix socket), its own /proc, and a
  tmpfs of `scratch_mb` at /tmp holding the scratch directory, pivots into it, and forks the
  program as a fresh unprivileged uid (`sandbox_uid`) with rlimits on CPU time, address space,
  file size, processes and open files. The program sees only a loopback device (no network,
  no abstract socket of the host), cannot write anything but its scratch tmpfs, cannot see or
  signal the host's processes, and dies with everything it started when it exits or is killed
  (it is in a PID namespace whose init is the boot process).
- **user-namespace** (not root, `unshare -r` allowed): the same namespaces and root inside a
  user namespace; no uid change (the program is uid 0 of its namespace, with every capability
  dropped), so RLIMIT_NPROC counts the calling user's processes.
- **auto** picks the first of those that works here (probed once per process by running a
  program through it). Where neither works (no util-linux `unshare`, no root and no user
  namespaces, or mounts refused), `auto` and `namespaces` refuse to run programs:
  `SandboxUnavailable` says why in one line (the trainer checks at start, see `require`).
  Inside a reward worker that Landlock restricts (as `mrl train` runs them), mounts are refused,
  so the worker's programs are started by a launcher forked before the restriction
  (`mrl.reward.sandbox_launcher`), which gets the full sandbox.
- **rlimits** (only when named: `reward.code.isolation = "rlimits"`; unsafe for untrusted code):
  rlimits, its own session and a scratch directory as the working directory; the network, the
  host's processes and every file the caller can read or write stay reachable.

Whatever the mode, the parent reads at most `max_output_bytes` of stdout (more kills the program:
"output_limit") and kills the whole process group at the wall timeout. A program is
never trusted to report its own result: see `mrl.reward.code` for the harness.
"""
from __future__ import annotations

import itertools
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

Isolation = Literal["auto", "namespaces", "rlimits"]
MOUNT_MODES = ("namespaces", "user-namespace")
BOOT = Path(__file__).with_name("code_sandbox_boot.py")
UID_BASE = 200000
_uids = itertools.count()


def sandbox_uid() -> int:
    """A uid no other live sandbox uses: 4096 per process id (cycling), so concurrent reward workers
    never share one (RLIMIT_NPROC counts per uid)."""
    return UID_BASE + (os.getpid() % 65536) * 4096 + next(_uids) % 4096
_MODE: dict[str, str] = {}
# set in a Landlock-restricted reward worker by `mrl.reward.sandbox_launcher.start`: runs a program
# through the launcher forked before the restriction (same arguments and result as `run_sandboxed`)
LAUNCHER = None   # isolation request -> mode found on this machine (probed once per process)


@dataclass(frozen=True)
class Limits:
    """Per-run limits (the `reward.code` table)."""

    wall_s: float = 5.0
    cpu_s: int = 4
    memory_mb: int = 512
    max_output_bytes: int = 1 << 20
    file_size_mb: int = 16
    scratch_mb: int = 64
    processes: int = 32
    open_files: int = 64
    python: str = "auto"   # the programs' interpreter; "auto": `program_python`


@dataclass(frozen=True)
class RunResult:
    """What a sandboxed run did. `status`: "ok" (exit 0), "error" (nonzero exit), "timeout" (wall),
    "cpu" (RLIMIT_CPU), "memory" (MemoryError or killed by the address-space limit),
    "output_limit" (printed more than allowed), "sandbox" (could not start)."""

    status: str
    returncode: int | None
    stdout: bytes
    stderr_tail: bytes
    channel: bytes  # what the harness wrote to fd 3
    seconds: float


def _others_can_run(path: str) -> bool:
    """Whether a user that owns nothing here can execute `path` (every directory on the way searchable)."""
    real = os.path.realpath(path)
    if not os.path.isfile(real) or not os.stat(real).st_mode & 0o001:
        return False
    parent = os.path.dirname(real)
    while True:
        if not os.stat(parent).st_mode & 0o001:
            return False
        if parent == "/":
            return True
        parent = os.path.dirname(parent)


def program_python(setting: str = "auto", mode: str = "namespaces") -> str:
    """The interpreter programs run with: `setting` when not "auto"; else this process's Python when
    the sandbox uid can run it (or the mode keeps the caller's uid), else the system's python3."""
    if setting != "auto":
        return setting
    if mode != "namespaces" or _others_can_run(sys.executable):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"):
        if _others_can_run(candidate):
            return candidate
    return sys.executable   # the run fails as "sandbox" with the permission error in its stderr


class SandboxUnavailable(RuntimeError):
    """No sandbox with a mount namespace here: untrusted programs are not run (one line why)."""


_NS = ["--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc"]


def _probe(mode: str) -> str | None:
    """None when a trivial program runs in `mode` through the real boot, else why not."""
    try:
        result = _run_in(mode, {"probe.py": "pass\n"}, ["probe.py"], b"", Limits(wall_s=30.0, cpu_s=10), b"")
    except OSError as e:
        return str(e)
    if result.status == "ok":
        return None
    tail = result.stderr_tail.decode(errors="replace").strip().splitlines()
    return (tail[-1] if tail else result.status)[:200]


def isolation_mode(requested: Isolation = "auto") -> str:
    """"namespaces", "user-namespace" or (only when requested) "rlimits": the strongest mode that
    works here, probed once per process. `SandboxUnavailable` when `requested` is "auto" or
    "namespaces" and no mount-namespace mode works (the message says why)."""
    if requested in _MODE:
        return _MODE[requested]
    if requested == "rlimits":
        _MODE[requested] = "rlimits"
        return "rlimits"
    if requested not in ("auto", "namespaces"):
        raise ValueError(f"reward.code.isolation = {requested!r}: expected auto, namespaces or rlimits")
    unshare = shutil.which("unshare")
    if not unshare:
        raise SandboxUnavailable("reward.code: no sandbox for untrusted programs here: util-linux `unshare` is not "
                                 "installed (needed for network/mount/PID namespaces); set reward.code.isolation = "
                                 "'rlimits' only for programs you trust")
    why = []
    for mode in (("namespaces",) if os.geteuid() == 0 else ()) + ("user-namespace",):
        problem = _probe(mode)
        if problem is None:
            _MODE[requested] = mode
            return mode
        why.append(f"{mode}: {problem}")
    raise SandboxUnavailable("reward.code: no sandbox with a mount namespace here, so untrusted programs are not run ("
                             + "; ".join(why) + "); set reward.code.isolation = 'rlimits' only for programs you trust")


def require(isolation: Isolation) -> str:
    """`isolation_mode(isolation)` as a one-line `UserError` (for the trainer's start)."""
    from mrl.errors import UserError

    try:
        return isolation_mode(isolation)
    except SandboxUnavailable as e:
        raise UserError(str(e)) from None


def _command(mode: str, uid: int, limits: Limits, scratch: str, job: str) -> list[str]:
    boot = [sys.executable, "-I", "-S", str(BOOT), mode, str(uid), scratch, job, program_python(limits.python, mode),
            *(str(v) for v in (limits.cpu_s, limits.memory_mb, limits.file_size_mb, limits.scratch_mb,
                               limits.processes, limits.open_files))]
    if mode == "namespaces":
        return [shutil.which("unshare"), *_NS, *boot]
    if mode == "user-namespace":
        return [shutil.which("unshare"), "--map-root-user", *_NS, *boot]
    return boot


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except ProcessLookupError:
        pass


def run_sandboxed(files: dict[str, str], argv: list[str], stdin: bytes, limits: Limits,
                  isolation: Isolation = "auto", secret: bytes = b"") -> RunResult:
    """Write `files` into a scratch directory, run `python -I <argv>` there under `limits`, feed
    `stdin`; `secret` is readable once on fd 4 (the harness's nonce), fd 3 is the result channel.
    In a Landlock-restricted reward worker the run goes through its launcher (same result)."""
    if isolation != "rlimits" and LAUNCHER is not None:
        return LAUNCHER(files, argv, stdin, limits, isolation, secret)
    return _run_in(isolation_mode(isolation), files, argv, stdin, limits, secret)


def _run_in(mode: str, files: dict[str, str], argv: list[str], stdin: bytes, limits: Limits,
            secret: bytes) -> RunResult:
    uid = sandbox_uid()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mrl-code-") as job:
        os.chmod(job, 0o700)
        for name, text in files.items():
            Path(job, name).write_text(text, encoding="utf-8")
        Path(job, "argv").write_text("\0".join(argv), encoding="utf-8")
        scratch = "/tmp/mrl-scratch" if mode in MOUNT_MODES else os.path.join(job, "scratch")
        chan_r, chan_w = os.pipe()
        sec_r, sec_w = os.pipe()
        os.write(sec_w, secret)
        os.close(sec_w)
        try:
            proc = subprocess.Popen(_command(mode, uid, limits, scratch, job), stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(chan_w, sec_r),
                                    start_new_session=True, env=_env(chan_w, sec_r), cwd=job)
        except OSError as e:
            os.close(chan_r)
            return RunResult("sandbox", None, b"", str(e).encode(), b"", 0.0)
        finally:
            os.close(chan_w)
            os.close(sec_r)
        try:
            status, out, err, chan = _collect(proc, stdin, chan_r, limits, started)
        finally:
            os.close(chan_r)
    code = proc.returncode
    if status == "ok":
        status = _exit_status(code, err)
    return RunResult(status, code, bytes(out), bytes(err[-4096:]), bytes(chan), time.monotonic() - started)


def _env(chan_w: int, sec_r: int) -> dict[str, str]:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
           "PYTHONDONTWRITEBYTECODE": "1", "MRL_CHANNEL_FD": str(chan_w), "MRL_SECRET_FD": str(sec_r)}
    for key in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[key] = "1"
    return env


def _exit_status(code: int | None, err: bytearray) -> str:
    if code == 0:
        return "ok"
    tail = bytes(err[-4096:])
    if code == 127 and tail.startswith(b"sandbox: "):
        return "sandbox"
    if b"MemoryError" in tail or code in (-signal.SIGSEGV, 128 + signal.SIGSEGV) and b"Cannot allocate" in tail:
        return "memory"
    if code in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        return "cpu"
    return "error"


def _drain(sel, out: bytearray, err: bytearray, chan: bytearray, limits: Limits) -> None:
    """After exit: read what is already in the pipes without waiting for writers that are still alive."""
    for key in list(sel.get_map().values()):
        if key.data is None or not isinstance(key.data, bytearray):
            continue
        fd = key.fileobj if isinstance(key.fileobj, int) else key.fileobj.fileno()
        os.set_blocking(fd, False)
        cap = limits.max_output_bytes + 1 if key.data is out else 65536
        while len(key.data) < cap:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            key.data.extend(chunk)


def _collect(proc: subprocess.Popen, stdin: bytes, chan_r: int, limits: Limits, started: float):
    """Feed stdin, read stdout (capped), stderr (last 64 KiB) and the channel until exit or a limit."""
    out, err, chan = bytearray(), bytearray(), bytearray()
    sel = selectors.DefaultSelector()
    os.set_blocking(proc.stdin.fileno(), False)
    pending = memoryview(stdin)
    if pending:
        sel.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    sel.register(chan_r, selectors.EVENT_READ, chan)
    pidfd = os.pidfd_open(proc.pid)
    sel.register(pidfd, selectors.EVENT_READ, None)   # exit ends the run even if its children hold the pipes
    status, deadline = "ok", started + limits.wall_s
    open_reads, exited = 3, False
    try:
        while open_reads and not exited:
            left = deadline - time.monotonic()
            if left <= 0:
                status = "timeout"
                break
            for key, _ in sel.select(timeout=left):
                if key.fileobj is proc.stdin:
                    try:
                        n = os.write(proc.stdin.fileno(), pending[:65536])
                    except (BrokenPipeError, OSError):
                        n = len(pending)
                    pending = pending[n:]
                    if not pending:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                if key.fileobj == pidfd:
                    exited = True
                    continue
                fd = key.fileobj if isinstance(key.fileobj, int) else key.fileobj.fileno()
                chunk = os.read(fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    open_reads -= 1
                    continue
                key.data.extend(chunk)
                if key.data is err and len(err) > 65536:
                    del err[:-65536]
                if key.data is chan and len(chan) > 65536:
                    del chan[65536:]
                if key.data is out and len(out) > limits.max_output_bytes:
                    status = "output_limit"
                    del out[limits.max_output_bytes:]
                    open_reads = 0
                    break
        if exited and status == "ok":
            _drain(sel, out, err, chan, limits)
            if len(out) > limits.max_output_bytes:
                status = "output_limit"
                del out[limits.max_output_bytes:]
    finally:
        sel.close()
        os.close(pidfd)
        _kill(proc)   # the group: anything the program left running
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:   # stdout closed early, the process still runs
            status = "timeout"
            _kill(proc)
            proc.wait()
        if not proc.stdin.closed:
            try:
                proc.stdin.close()
            except OSError:
                pass
        proc.stdout.close()
        proc.stderr.close()
    return status, out, err, chan
