"""Which launcher started this process, and the rank, world and rendezvous it gives.

Launchers (detected from the environment, first match wins):

| launcher | detected by | rank / world / local rank | rendezvous |
| --- | --- | --- | --- |
| torchrun | `RANK` and `WORLD_SIZE` | `RANK`, `WORLD_SIZE`, `LOCAL_RANK` | TCP store at `MASTER_ADDR`:`MASTER_PORT` (torchrun's agent hosts it) |
| Slurm `srun` | `SLURM_PROCID` and `SLURM_NTASKS` | `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID` | TCP store hosted by rank 0 on `MASTER_ADDR` or the first host of `SLURM_STEP_NODELIST` / `SLURM_JOB_NODELIST`; port `MASTER_PORT` or derived from `SLURM_JOB_ID` |
| single | neither | 0 / 1 / 0 | in-process hash store |

The backend is nccl on the cuda platform and gloo on cpu unless the job says otherwise.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import re
import shutil
import subprocess
from typing import Mapping, Optional

from mrl.errors import UserError


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as told by its launcher."""

    launcher: str  # "torchrun" | "slurm" | "single"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: Optional[str] = None
    master_port: Optional[int] = None


def _int_env(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise UserError(f"environment variable {key}={env[key]!r} is not an integer") from None


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm compressed host list: `node[01-03,07],gpu5` -> node01 node02 node03 node07 gpu5.

    Handles zero padding, several bracket groups in one name (`r[1-2]-n[01-02]`, expanded as a
    cartesian product in Slurm's order) and comma-separated items. Raises `ValueError` on a
    malformed list.
    """
    items, depth, cur = [], 0, []
    for ch in nodelist.strip():
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in nodelist {nodelist!r}")
        if ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise ValueError(f"unbalanced '[' in nodelist {nodelist!r}")
    items.append("".join(cur))

    hosts: list[str] = []
    for item in items:
        item = item.strip()
        if not item:
            continue
        parts = re.split(r"(\[[^\]]*\])", item)
        choices: list[list[str]] = []
        for part in parts:
            if part.startswith("["):
                choices.append(_expand_range_list(part[1:-1], nodelist))
            elif part:
                choices.append([part])
        hosts.extend("".join(p) for p in itertools.product(*choices))
    if not hosts:
        raise ValueError(f"empty nodelist {nodelist!r}")
    return hosts


def _expand_range_list(spec: str, nodelist: str) -> list[str]:
    out = []
    for rng in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", rng)
        if not m:
            raise ValueError(f"bad range {rng!r} in nodelist {nodelist!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"descending range {rng!r} in nodelist {nodelist!r}")
        width = len(lo)
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def first_host(nodelist: str) -> str:
    """The first host of a Slurm nodelist (the rendezvous host); falls back to `scontrol`."""
    try:
        return expand_nodelist(nodelist)[0]
    except ValueError:
        if shutil.which("scontrol") is None:
            raise UserError(f"cannot parse SLURM nodelist {nodelist!r} and scontrol is not on PATH") from None
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=30, check=False)
        hosts = out.stdout.split()
        if out.returncode != 0 or not hosts:
            raise UserError(f"cannot expand SLURM nodelist {nodelist!r}: scontrol said {out.stderr.strip()!r}") from None
        return hosts[0]


def slurm_master_port(env: Mapping[str, str]) -> int:
    """`MASTER_PORT` if set, else a port derived from the job id so that concurrent jobs sharing a
    node do not collide (15000-29999: below Linux's default ephemeral range)."""
    if "MASTER_PORT" in env:
        return _int_env(env, "MASTER_PORT")
    job = env.get("SLURM_JOB_ID", "0")
    return 15000 + (int(job) if job.isdigit() else 0) % 15000


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read rank, world size and rendezvous address from torchrun's or Slurm's variables."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int_env(env, "WORLD_SIZE")
        return LaunchEnv(
            launcher="torchrun",
            rank=_int_env(env, "RANK"),
            world_size=world,
            local_rank=_int_env(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            local_world_size=_int_env(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world,
            master_addr=env.get("MASTER_ADDR"),
            master_port=_int_env(env, "MASTER_PORT") if "MASTER_PORT" in env else None,
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if "MASTER_ADDR" in env:
            addr = env["MASTER_ADDR"]
        elif nodelist:
            addr = first_host(nodelist)
        else:
            raise UserError("SLURM_PROCID is set but no SLURM_*NODELIST or MASTER_ADDR names the rendezvous host")
        world = _int_env(env, "SLURM_NTASKS")
        local_world = world
        tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        if tasks_per_node:
            # e.g. "4(x2),3": tasks on the first node; homogeneous layouts are the norm.
            m = re.match(r"(\d+)", tasks_per_node)
            if m:
                local_world = int(m.group(1))
        return LaunchEnv(
            launcher="slurm",
            rank=_int_env(env, "SLURM_PROCID"),
            world_size=world,
            local_rank=_int_env(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            local_world_size=local_world,
            master_addr=addr,
            master_port=slurm_master_port(env),
        )
    return LaunchEnv(launcher="single", rank=0, world_size=1, local_rank=0, local_world_size=1)


def check_world_size(launched: int, expected: int, launcher: str) -> None:
    """Raise `UserError` when the launch and the job disagree on the number of ranks."""
    if launched != expected and launcher == "single":
        raise UserError(
            f"the job expects world size {expected} (platform.nodes x platform.ranks_per_node) but this is one "
            f"plain process, not a torchrun or srun launch: start it with `mrl launch JOB` (one machine), "
            f"`torchrun --nproc_per_node {expected} -m mrl train JOB` or launch/slurm.sh"
        )
    if launched != expected:
        hint = {
            "torchrun": "torchrun --nnodes/--nproc_per_node",
            "slurm": "sbatch/srun --nodes/--ntasks-per-node",
            "single": "a plain `python` run (one process); launch with torchrun or srun for more",
        }[launcher]
        raise UserError(
            f"the job expects world size {expected} (platform.nodes x platform.ranks_per_node) "
            f"but {launcher} started {launched} rank(s) ({hint}); make them agree"
        )


def resolve_backend(backend: str, device: str) -> str:
    """`auto` -> nccl on cuda, gloo on cpu; nccl on cpu is refused."""
    if backend == "auto":
        return "nccl" if device == "cuda" else "gloo"
    if backend == "nccl" and device == "cpu":
        raise UserError("platform.backend = 'nccl' needs platform.device = 'cuda'; use 'gloo' (or 'auto') on cpu")
    return backend
