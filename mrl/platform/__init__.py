"""The platform layer: every CPU/CUDA difference lives here.

    from mrl.platform import setup, stage

    with setup(job.platform, job.parallel, seed=job.seed) as ctx:   # process group, megatron groups, RNG
        ...
        with stage("weight sync"):                                   # a hang becomes CollectiveTimeout
            ...

`setup` checks the device, reads the launcher's environment (torchrun, Slurm `srun`, or a plain
`python` run as world 1), checks the world size against the job, creates the default process
group (nccl on cuda, gloo on cpu) with the job's collective timeout, activates the CPU
compatibility layer on cpu, creates megatron's TP/PP/CP/EP/DP groups and seeds its RNG streams.
`teardown` (or leaving the `with` block) undoes all of it.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Importing `mrl.platform.config` (the job-spec sections) must stay cheap: torch and megatron are
# imported only when a runtime name below is first used.
_LAZY = {
    "Context": "mrl.platform.runtime", "setup": "mrl.platform.runtime", "teardown": "mrl.platform.runtime",
    "current": "mrl.platform.runtime",
    "stage": "mrl.platform.dist", "current_stage": "mrl.platform.dist", "detect_launch": "mrl.platform.launch",
    "expand_nodelist": "mrl.platform.launch", "LaunchEnv": "mrl.platform.launch",
    "ParallelLayout": "mrl.platform.parallel",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:
    from mrl.platform.dist import current_stage, stage
    from mrl.platform.launch import LaunchEnv, detect_launch, expand_nodelist
    from mrl.platform.parallel import ParallelLayout
    from mrl.platform.runtime import Context, current, setup, teardown


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mrl.platform' has no attribute {name!r}")
