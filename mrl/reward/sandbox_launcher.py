"""The code sandbox as seen from a Landlock-restricted reward worker.

Landlock forbids a restricted process to mount anything, even in a mount namespace of its own,
so a reward worker restricted by `mrl.reward.sandbox.deny_writes` cannot build the code
sandbox's root. Before restricting itself the worker forks a launcher (`start`): an
unrestricted copy of itself that runs nothing of the user's, only sandboxed programs on the
worker's behalf. `run` (what `code_sandbox.run_sandboxed` calls in such a worker) hands one
socket of a fresh pair to the launcher; the launcher forks a handler per request, which runs
the program in the full sandbox and answers on that socket.

What the launcher accepts: files, argv, stdin, the limits and the secret, as JSON; it always
runs them with a mount-namespace isolation ("auto" or "namespaces": a request for "rlimits"
would run code unrestricted, and is refused). The launcher dies with the worker
(PR_SET_PDEATHSIG), and the worker, a child subreaper, kills the launcher's tree with its own.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import os
import signal
import socket
import struct
import threading
from typing import Optional

__all__ = ["start", "stop", "available", "run"]

_CLIENT: Optional[socket.socket] = None
_LOCK = threading.Lock()
_MAX_MESSAGE = 256 << 20


def available() -> bool:
    """Whether this process runs its sandboxed programs through a launcher."""
    return _CLIENT is not None


def stop() -> None:
    """Close the launcher (it ends when its socket closes); programs run here directly again."""
    global _CLIENT
    from mrl.reward import code_sandbox

    if _CLIENT is not None:
        _CLIENT.close()
    _CLIENT = None
    code_sandbox.LAUNCHER = None


def start() -> None:
    """Fork the launcher (call it before the process restricts itself; single-threaded)."""
    global _CLIENT
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        mine.close()
        try:
            from mrl.platform.lifetime import die_with_parent

            die_with_parent()
            _serve(theirs)
        finally:
            os._exit(0)
    theirs.close()
    _CLIENT = mine
    from mrl.reward import code_sandbox

    code_sandbox.LAUNCHER = run


def _send(sock: socket.socket, body: dict) -> None:
    data = json.dumps(body).encode()
    sock.sendall(struct.pack("<Q", len(data)) + data)


def _recv(sock: socket.socket) -> dict:
    head = _exactly(sock, 8)
    (size,) = struct.unpack("<Q", head)
    if size > _MAX_MESSAGE:
        raise OSError(f"sandbox launcher message of {size} bytes")
    return json.loads(_exactly(sock, size))


def _exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(min(n - len(out), 1 << 20))
        if not chunk:
            raise EOFError("sandbox launcher connection closed")
        out += chunk
    return bytes(out)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def run(files: dict, argv: list, stdin: bytes, limits, isolation: str, secret: bytes):
    """`code_sandbox.run_sandboxed` through the launcher."""
    from mrl.reward.code_sandbox import RunResult

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _LOCK:
            socket.send_fds(_CLIENT, [b"r"], [theirs.fileno()])
        theirs.close()
        _send(ours, {"files": files, "argv": list(argv), "stdin": _b64(stdin), "limits": dataclasses.asdict(limits),
                     "isolation": isolation, "secret": _b64(secret)})
        got = _recv(ours)
    except (OSError, EOFError, ValueError) as e:
        return RunResult("sandbox", None, b"", f"sandbox launcher: {e}".encode(), b"", 0.0)
    finally:
        ours.close()
    return RunResult(got["status"], got["returncode"], base64.b64decode(got["stdout"]),
                     base64.b64decode(got["stderr_tail"]), base64.b64decode(got["channel"]), float(got["seconds"]))


def _serve(control: socket.socket) -> None:
    """The launcher's loop: one forked handler per request; ends when the worker closes the socket."""
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(control, 16, 4)
        except OSError:
            return
        if not msg:
            return
        for fd in fds[1:]:
            os.close(fd)
        if not fds:
            continue
        if os.fork() == 0:
            control.close()
            try:
                _handle(socket.socket(fileno=fds[0]))
            finally:
                os._exit(0)
        os.close(fds[0])
        while True:   # reap finished handlers
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break


def _handle(conn: socket.socket) -> None:
    from mrl.reward.code_sandbox import Limits, RunResult, _run_in, isolation_mode

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        req = _recv(conn)
        isolation = req["isolation"] if req["isolation"] in ("auto", "namespaces") else "refused"
        if isolation == "refused":
            result = RunResult("sandbox", None, b"", b"sandbox launcher: only mount-namespace isolation is run here",
                               b"", 0.0)
        else:
            fields = {f.name for f in dataclasses.fields(Limits)}
            limits = Limits(**{k: v for k, v in req["limits"].items() if k in fields})
            try:
                mode = isolation_mode(isolation)
            except RuntimeError as e:
                result = RunResult("sandbox", None, b"", str(e).encode(), b"", 0.0)
            else:
                result = _run_in(mode, {str(k): str(v) for k, v in req["files"].items()}, [str(a) for a in req["argv"]],
                                 base64.b64decode(req["stdin"]), limits, base64.b64decode(req["secret"]))
        _send(conn, {"status": result.status, "returncode": result.returncode, "stdout": _b64(result.stdout),
                     "stderr_tail": _b64(result.stderr_tail), "channel": _b64(result.channel),
                     "seconds": result.seconds})
    except (OSError, EOFError, ValueError, TypeError, KeyError):
        return
    finally:
        conn.close()
