"""Run a test script under `torchrun --nproc_per_node N` (gloo on CPU) and check it passed."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def repo_pythonpath() -> str:
    """PYTHONPATH for child processes: this checkout first, then what the caller had (on a bare GPU
    box megatron-core & co. come from a wheel folder on PYTHONPATH: tools/gpu/check.py)."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO)]
    return os.pathsep.join([str(REPO), *rest])


def run_torchrun(script: str | Path, *args: str, nproc: int = 2, timeout: float = 300,
                 env: dict | None = None) -> subprocess.CompletedProcess:
    """Launch `script` (a path, or "-m module") on `nproc` local ranks; fail the calling test with
    all output if any rank fails."""
    target = str(script).split() if str(script).startswith("-m ") else [str(script)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *target, *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo_pythonpath(), **(env or {})}
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {script} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


def print_result(tag: object, payload: object) -> None:
    """Print `RESULT <tag> <payload as JSON>` from rank 0 only (RANK unset counts as rank 0). Every
    rank's stdout shares torchrun's pipe, and two ranks' long lines can interleave inside one line;
    the metrics a run returns are the same on every rank."""
    import json

    if int(os.environ.get("RANK", "0")) == 0:
        print(f"RESULT {tag} {json.dumps(payload, sort_keys=True)}", flush=True)


def kill_process_group(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGKILL every process of `proc`'s session (started with `start_new_session=True`) and wait
    until none is left: waiting for the launcher alone is not enough, its ranks can still exist
    (dying, or zombies waiting to be reaped) when a resumed run checks the run directory's lock
    owner, and a loaded machine widens that window to seconds."""
    import signal
    import time

    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"processes of the killed group {proc.pid} still exist after {timeout:.0f} s")
