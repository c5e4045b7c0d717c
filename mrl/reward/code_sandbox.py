"""Run one untrusted Python program in a sandbox: namespaces, a fresh uid, rlimits, a wall timeout.

`run_sandboxed(argv_files, stdin, limits)` starts, in order of what this machine allows:

- **namespaces** (root, `unshare` from util-linux): new network, mount and PID namespaces
  (`unshare --net --mount --pid --fork --kill-child --mount-proc`). Inside, `code_sandbox_boot.py`
  mounts a size-capped tmpfs over /tmp, /var/tmp and /dev/shm, makes the scratch directory there,
  and forks the program as a fresh unprivileged uid (`sandbox_uid`) with
  rlimits on CPU time, address space, file size, processes and open files. The program sees only
  a loopback device (no network), cannot write files root owns (the whole image), cannot signal
  or see the host's processes, and dies with everything it started when it exits or is killed
  (it is in a PID namespace whose init is the boot process).
- **namespaces-no-mount** (root, but mounts refused: inside a reward worker that Landlock
  restricts, as `mrl train` runs them): new network and PID namespaces and the fresh uid; the
  scratch directory is on the host, and the boot process adds a Landlock ruleset that allows
  writes only inside it (where Landlock is enabled; else the uid's permissions alone, which
  still allow world-writable directories such as /tmp). The program sees the host's /proc
  (read-only facts; it cannot signal other uids' processes).
- **user-namespace** (not root, `unshare -r` allowed): the same namespaces inside a user
  namespace; no uid change, so RLIMIT_NPROC counts the calling user's processes and the program
  can write what the calling user can outside the tmpfs mounts.
- **rlimits** (neither works, or `isolation = "rlimits"`): rlimits, its own session and a scratch
  directory as the working directory; the network and the caller's files stay reachable. Logged
  once as a warning.

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
BOOT = Path(__file__).with_name("code_sandbox_boot.py")
UID_BASE = 200000
_uids = itertools.count()


def sandbox_uid() -> int:
    """A uid no other live sandbox uses: 4096 per process id (cycling), so concurrent reward workers
    never share one (RLIMIT_NPROC counts per uid)."""
    return UID_BASE + (os.getpid() % 65536) * 4096 + next(_uids) % 4096
_MODE: dict[str, str] = {}   # isolation request -> mode found on this machine (probed once per process)


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
    if mode not in ("namespaces", "namespaces-no-mount") or _others_can_run(sys.executable):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"):
        if _others_can_run(candidate):
            return candidate
    return sys.executable   # the run fails as "sandbox" with the permission error in its stderr


def _probe(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd + [sys.executable, "-I", "-S", "-c", "pass"], timeout=30,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


_NS = ["--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc"]
_NS_NO_MOUNT = ["--net", "--pid", "--fork", "--kill-child"]


def isolation_mode(requested: Isolation = "auto") -> str:
    """"namespaces", "namespaces-no-mount", "user-namespace" or "rlimits": the strongest mode that
    works here (probed once per process).
    `requested = "namespaces"` raises `RuntimeError` where no namespace mode works."""
    if requested in _MODE:
        return _MODE[requested]
    mode = "rlimits"
    unshare = shutil.which("unshare")
    if requested != "rlimits" and unshare:
        if os.geteuid() == 0 and _probe([unshare, *_NS]):
            mode = "namespaces"
        elif os.geteuid() == 0 and _probe([unshare, *_NS_NO_MOUNT]):
            mode = "namespaces-no-mount"   # e.g. inside a Landlock-restricted reward worker: no mounts allowed
        elif _probe([unshare, "--map-root-user", *_NS]):
            mode = "user-namespace"
    if requested == "namespaces" and mode == "rlimits":
        raise RuntimeError("reward.code.isolation = 'namespaces' but `unshare --net --mount --pid` does not work here "
                           "(needs util-linux unshare and root or unprivileged user namespaces)")
    if requested == "auto" and mode == "rlimits":
        log.warning("code reward: no network/mount/PID namespaces here (unshare unavailable or refused); programs "
                    "run with rlimits and a scratch directory only: they can reach the network and the files this "
                    "user can write")
    _MODE[requested] = mode
    return mode


def _command(mode: str, uid: int, limits: Limits, scratch: str, job: str) -> list[str]:
    boot = [sys.executable, "-I", "-S", str(BOOT), mode, str(uid), scratch, job, program_python(limits.python, mode),
            *(str(v) for v in (limits.cpu_s, limits.memory_mb, limits.file_size_mb, limits.scratch_mb,
                               limits.processes, limits.open_files))]
    if mode == "namespaces":
        return [shutil.which("unshare"), *_NS, *boot]
    if mode == "namespaces-no-mount":
        return [shutil.which("unshare"), *_NS_NO_MOUNT, *boot]
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
    `stdin`; `secret` is readable once on fd 4 (the harness's nonce), fd 3 is the result channel."""
    mode = isolation_mode(isolation)
    uid = sandbox_uid()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mrl-code-") as job:
        for name, text in files.items():
            Path(job, name).write_text(text, encoding="utf-8")
        Path(job, "argv").write_text("\0".join(argv), encoding="utf-8")
        scratch = ("/tmp/mrl-scratch" if mode in ("namespaces", "user-namespace")
                   else _host_scratch() if mode == "namespaces-no-mount" else os.path.join(job, "scratch"))
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
            if mode == "namespaces-no-mount":
                shutil.rmtree(scratch, ignore_errors=True)
            return RunResult("sandbox", None, b"", str(e).encode(), b"", 0.0)
        finally:
            os.close(chan_w)
            os.close(sec_r)
        try:
            status, out, err, chan = _collect(proc, stdin, chan_r, limits, started)
        finally:
            os.close(chan_r)
            if mode == "namespaces-no-mount":
                shutil.rmtree(scratch, ignore_errors=True)
    code = proc.returncode
    if status == "ok":
        status = _exit_status(code, err)
    return RunResult(status, code, bytes(out), bytes(err[-4096:]), bytes(chan), time.monotonic() - started)


def _host_scratch() -> str:
    """A fresh scratch directory on the host that the sandbox uid can reach (Python opens its script
    by absolute path, so every directory above it must be searchable): `mrl-code/` (0711) in the
    first of /tmp, /var/tmp, /dev/shm where this process may create it."""
    problems = []
    for base in ("/tmp", "/var/tmp", "/dev/shm"):
        root = os.path.join(base, "mrl-code")
        try:
            os.makedirs(root, mode=0o711, exist_ok=True)
            os.chmod(root, 0o711)
            return tempfile.mkdtemp(dir=root)
        except OSError as e:
            problems.append(f"{root}: {e.strerror}")
    raise OSError(f"no scratch directory for the code sandbox ({'; '.join(problems)})")


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
