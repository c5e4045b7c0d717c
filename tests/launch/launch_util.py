"""Shared pieces of the launch tier: the job, the messages to expect, the virtualenv the launch
scripts use and a clean environment for them.

The launch scripts take the virtualenv from MRL_VENV (default `.venv`); the tests pass the repo's
`.venv` as an absolute path, or MRL_VENV when the caller set it.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JOB = "jobs/quickstart_cpu.toml"
# What `mrl validate` prints for a good job; the ranks of a validate run each print it once.
OK_LINE = re.compile(r"^ok: jobs/quickstart_cpu\.toml: world 2 = ", re.M)
# A misspelt key that the validator rejects with a one-line, did-you-mean message.
BAD_OVERRIDE = "rollout.temprature=0.7"
BAD_MESSAGE = "error: command line: rollout.temprature: unknown key; did you mean `rollout.temperature`?"

# Variables a launcher or an enclosing job may have set that would change how ranks see the world.
_LAUNCH_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                "MASTER_ADDR", "MASTER_PORT", "MRL_COMMAND", "MRL_VENV"}


def find_venv() -> Path:
    """The virtualenv to hand the launch scripts; skips the test if there is none."""
    venv = Path(os.environ.get("MRL_VENV") or REPO / ".venv")
    if not venv.is_absolute():
        venv = REPO / venv
    if not (venv / "bin" / "python").exists():
        pytest.skip(f"no virtualenv at {venv} (run `make setup`, or set MRL_VENV)")
    return venv


def launch_env(venv: Path, command: str | None, **extra: str) -> dict[str, str]:
    """os.environ without any launcher's or enclosing allocation's variables, plus MRL_VENV and
    MRL_COMMAND (left unset when `command` is None: the launcher's default, train)."""
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCH_VARS and not k.startswith(("SLURM_", "PET_", "TORCHELASTIC_", "MLFLOW_"))}
    env.update(MRL_VENV=str(venv), OMP_NUM_THREADS="1", **extra)
    if command is not None:
        env["MRL_COMMAND"] = command
    return env
