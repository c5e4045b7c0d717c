"""Launching an SGLang server (pinned: `SGLANG_VERSION`) as a child process of the trainer.

`python -m sglang.launch_server` with the job's settings (`server_command`), its output to a log
file in the run directory, in a process group of its own that is killed with the trainer: at
`shutdown`, at interpreter exit, and (Linux) by the kernel when the launching thread dies
(`PR_SET_PDEATHSIG`; SGLang's own worker processes follow their parent the same way:
`kill_itself_when_parent_died`, `sglang/srt/utils/common.py`). `wait_healthy` polls
`/health_generate` (`http_server.py: health_generate`: 200 once a one-token generation went
through) until a bounded deadline, and names the log when the process died or never answered.
"""
from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import httpx

from mrl.errors import UserError

SGLANG_VERSION = "0.5.23"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def server_args(values: dict) -> list[str]:
    """`{"mem_fraction_static": 0.5, "enable_memory_saver": True}` as SGLang's command line: a
    field `x_y` is `--x-y` (`arg_groups/arg_utils.py`), a true bool is a bare flag (store_true), a
    false or None one is left out, a list is repeated values."""
    out: list[str] = []
    for key, value in values.items():
        if value is None or value is False:
            continue
        if value is True:
            out.append(_flag(key))
        elif isinstance(value, (list, tuple)):
            out += [_flag(key), *map(str, value)]
        else:
            out += [_flag(key), str(value)]
    return out


def server_command(python: str, model_path: str, *, host: str, port: int, tp: int, dtype: str, seed: int,
                   mem_fraction: float, context_length: int, max_running_requests: int,
                   chunked_prefill_size: int, load_format: str, base_gpu_id: int, sleep_level: int,
                   disable_cuda_graph: bool, disable_radix_cache: bool, trust_remote_code: bool,
                   extra: Optional[dict] = None) -> list[str]:
    """The launch command. Names are 0.5.23's `ServerArgs` fields (`sglang/srt/arg_groups/fields/`).

    Always: `skip_tokenizer_init` (token ids in and out, never re-tokenized) and
    `enable_deterministic_inference` (per-request `sampling_seed` is honoured only with it:
    `sampling_batch_info.py`). `sleep_level` 1 or 2 turns on the memory saver (release/resume
    memory occupation); 1 also keeps a CPU copy of the weights while asleep
    (`enable_weights_cpu_backup`), 2 drops them (the next sync is full). `extra`:
    `rollout.sglang.server_args`, which win over these."""
    values = {
        "model_path": model_path, "host": host, "port": port, "tp_size": tp, "dtype": dtype, "random_seed": seed,
        "mem_fraction_static": mem_fraction, "context_length": context_length,
        "max_running_requests": max_running_requests, "chunked_prefill_size": chunked_prefill_size,
        "load_format": load_format, "base_gpu_id": base_gpu_id, "skip_tokenizer_init": True,
        "enable_deterministic_inference": True, "enable_memory_saver": sleep_level > 0,
        "enable_weights_cpu_backup": sleep_level == 1, "disable_cuda_graph": disable_cuda_graph,
        "disable_radix_cache": disable_radix_cache, "trust_remote_code": trust_remote_code,
    }
    values.update(extra or {})
    return [python, "-m", "sglang.launch_server", *server_args(values)]


#: the trainer's torch.distributed launch variables, which the server's own process groups must not see
#: (under torchrun, TORCHELASTIC_USE_AGENT_STORE makes every tcp:// rendezvous a client of an agent store
#: that is not there; RANK / WORLD_SIZE / MASTER_* describe the trainer's world, not the server's)
_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def server_environment(environ) -> dict:
    """The trainer's environment less its torch.distributed launch variables."""
    return {k: v for k, v in environ.items() if k not in _LAUNCH_VARS and not k.startswith("TORCHELASTIC_")}


def _die_with_parent():   # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except OSError:
        pass


class ServerProcess:
    """One launched server: its process group, its log, its base URL."""

    def __init__(self, command: Sequence[str], *, url: str, log_path: Path, env: Optional[dict] = None,
                 name: str = "sglang"):
        self.command, self.url, self.log_path, self.name = list(command), url, Path(log_path), name
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**server_environment(os.environ), **(env or {})}, start_new_session=True,
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        atexit.register(self.stop)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])

    def death(self) -> Optional[str]:
        """None while it runs, else one line: its exit status and the end of its log."""
        if self.alive():
            return None
        tail = self.log_tail()
        return (f"the {self.name} server (pid {self.proc.pid}) exited with status {self.proc.returncode}; "
                f"log {self.log_path}" + (f": {tail}" if tail else ""))

    def wait_healthy(self, deadline_s: float, poll_s: float = 0.5) -> None:
        """Until `/health_generate` answers 200; one UserError line when the process dies or the
        deadline passes first."""
        end = time.monotonic() + deadline_s
        with httpx.Client(timeout=max(poll_s, 5.0)) as client:
            while True:
                dead = self.death()
                if dead:
                    raise UserError(f"rollout.engine = 'sglang': {dead}")
                try:
                    if client.get(f"{self.url}/health_generate").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() >= end:
                    self.stop()
                    raise UserError(f"rollout.sglang.launch_timeout_s: the {self.name} server at {self.url} was not "
                                    f"healthy after {deadline_s:g} s; log {self.log_path}")
                time.sleep(poll_s)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after `grace_s`."""
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        else:   # its workers may outlive it; they share its process group
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if not self._log.closed:
            self._log.close()
        atexit.unregister(self.stop)
