"""Which device this rank computes on, and CPU thread settings.

The platform is chosen by the job (`platform.device`), never guessed from the hardware: a job
that asks for `cuda` on a machine without a usable GPU fails at start-up with a `UserError`
instead of silently running somewhere else.
"""
from __future__ import annotations

import os

import torch

from mrl.errors import UserError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
"""The dtype names job specs and `mrl merge --dtype` accept, and their torch dtypes (the one map)."""

PLATFORMS = ("cuda", "cpu")


def check_platform(device: str) -> None:
    """Raise `UserError` if the requested platform cannot run in this process."""
    if device not in PLATFORMS:
        raise UserError(f"platform.device = {device!r} is not one of {', '.join(map(repr, PLATFORMS))}")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError(
            "platform.device = 'cuda' but torch.cuda.is_available() is False; "
            "set platform.device = 'cpu' for the CPU development platform"
        )


def rank_device(device: str, local_rank: int) -> torch.device:
    """The device this rank computes on: `cuda:<local_rank>` on the cuda platform, `cpu` on cpu.

    On cuda the local rank must name a visible GPU (one process per GPU); this is checked so that
    a launch with more ranks per node than GPUs fails here rather than deep inside NCCL.
    """
    check_platform(device)
    if device == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if not 0 <= local_rank < count:
        raise UserError(
            f"local rank {local_rank} has no GPU: this node shows {count} CUDA device(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
            "launch at most one rank per GPU (platform.ranks_per_node)"
        )
    return torch.device("cuda", local_rank)


def bind_device(dev: torch.device) -> None:
    """Make `dev` this process's current device (a no-op on cpu)."""
    if dev.type == "cuda":
        torch.cuda.set_device(dev)


def default_cpu_threads(local_world_size: int, cores: int | None = None) -> int:
    """Intra-op threads per rank when the job does not say: the usable cores split between ranks."""
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_world_size))


def configure_cpu_threads(cpu_threads: int | None, local_world_size: int) -> int:
    """Set torch's intra-op thread count for a CPU rank and return it.

    Without this every rank starts one thread per core, so N ranks on a node oversubscribe the
    cores N-fold and collectives stall behind busy threads.
    """
    n = cpu_threads if cpu_threads is not None else default_cpu_threads(local_world_size)
    torch.set_num_threads(n)
    return n
