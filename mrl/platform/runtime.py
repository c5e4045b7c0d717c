"""`setup` / `teardown`: bring a rank up for a job's platform and parallel sections (see
`mrl.platform`)."""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch

from mrl.platform import device as _device
from mrl.errors import UserError
from mrl.platform import dist as _dist
from mrl.platform import launch as _launch
from mrl.platform.bridge import ROLLOUT, Bridge, RoleSplit
from mrl.platform.config import ParallelConfig, PlatformConfig
from mrl.platform.dist import stage
from mrl.platform.parallel import ParallelLayout
from mrl.platform.quiet import quiet_known_warnings

log = logging.getLogger(__name__)

__all__ = ["Context", "setup", "teardown", "current"]


@dataclasses.dataclass(frozen=True)
class Context:
    """What a rank knows about its place in the job after `setup`."""

    platform: str            # "cuda" | "cpu"
    device: torch.device     # cuda:<local_rank> or cpu
    backend: str             # "nccl" | "gloo"
    launcher: str            # "torchrun" | "slurm" | "single"
    rank: int                # within this rank's role world (the default process group)
    world_size: int          # of the role world
    local_rank: int
    local_world_size: int
    layout: Optional[ParallelLayout]   # megatron's grid; None on ranks that only generate
    cpu_threads: Optional[int]
    seed: int
    role: str = "train"      # "train" (colocated ranks too) | "rollout" (rollout.placement = "separate")
    global_rank: int = 0     # in the whole launch
    bridge: Optional[Bridge] = None   # between the trainer's and the rollout's worlds, when split

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank

    @property
    def is_main(self) -> bool:
        """The rank that owns tracking and checkpoints: global rank 0 (trainer rank 0 when split)."""
        return self.global_rank == 0

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc) -> None:
        teardown()


_CURRENT: Optional[Context] = None
_COMPAT_ACTIVATED_BY_SETUP = False


def current() -> Context:
    """The active `Context`; raises if `setup` has not run."""
    if _CURRENT is None:
        raise RuntimeError("mrl.platform.setup() has not been called in this process")
    return _CURRENT


def setup(platform: PlatformConfig, parallel: ParallelConfig, seed: int, *,
          env: Optional[dict] = None, rollout_ranks: int = 0, bridge_timeout_s: Optional[float] = None) -> Context:
    """Bring this rank up for `platform` and `parallel`; returns its `Context` (also a context manager).

    `rollout_ranks` > 0 splits the launch (`mrl.platform.bridge`): the last `rollout_ranks` ranks
    get a world of their own without megatron's groups, the others a trainer world laid out by
    `parallel`, and both the bridge between them (its groups time out after `bridge_timeout_s`).

    Raises `UserError` for anything the user can fix (cuda requested but absent, world size
    different from `platform.nodes x platform.ranks_per_node`, a layout that does not divide the
    world, sequence parallelism on cpu) before any collective runs.
    """
    global _CURRENT, _COMPAT_ACTIVATED_BY_SETUP
    from mrl.platform import parallel as _parallel

    quiet_known_warnings()

    if _CURRENT is not None:
        raise RuntimeError("mrl.platform.setup() was already called; call teardown() first")
    _device.check_platform(platform.device)
    launch = _launch.detect_launch(env)
    _launch.check_world_size(launch.world_size, platform.world_size, launch.launcher)
    split = RoleSplit(launch.world_size, rollout_ranks)
    role = split.role_of(launch.rank)
    role_rank, role_world = split.role_rank(launch.rank)
    if split.separate and launch.launcher == "single":
        raise UserError("rollout.placement = 'separate' needs a multi-rank launch (torchrun or srun)")
    if split.separate and split.trainer_ranks < 1:
        raise UserError(f"rollout.ranks {rollout_ranks} of the world size {launch.world_size} leaves no rank to train")
    _parallel.check_layout(parallel, split.trainer_ranks, platform.device)
    backend = _launch.resolve_backend(platform.backend, platform.device)
    dev = _device.rank_device(platform.device, launch.local_rank)
    _device.bind_device(dev)
    threads = None
    if platform.device == "cpu":
        threads = _device.configure_cpu_threads(platform.cpu_threads, launch.local_world_size)

    # Import megatron only once the cheap checks passed (it takes seconds).
    from mrl.platform import cpu_compat

    if platform.device == "cpu":
        _COMPAT_ACTIVATED_BY_SETUP = not cpu_compat.is_active()
        cpu_compat.activate()
    else:
        cpu_compat.apply_megatron_fixes()

    try:
        with stage("process-group init", platform.init_timeout_s):
            store = _dist.init_process_group(launch, backend=backend, device=dev,
                                             collective_timeout_s=platform.collective_timeout_s,
                                             init_timeout_s=platform.init_timeout_s,
                                             role=role if split.separate else None, role_rank=role_rank,
                                             role_world=role_world)
        bridge = None
        if split.separate:
            with stage("trainer-rollout bridge init", platform.init_timeout_s):
                bridge = Bridge(split, launch.rank, store, timeout_s=bridge_timeout_s or platform.collective_timeout_s,
                                weights_backend=backend, device=dev)
        layout = None
        if role != ROLLOUT:
            with stage("model-parallel init", platform.init_timeout_s):
                layout = _parallel.initialize_model_parallel(parallel, collective_timeout_s=platform.collective_timeout_s)
            _parallel.seed_model_parallel(seed, platform.device)
        else:
            _parallel.seed_process(seed)
    except BaseException:
        _teardown_partial()
        raise

    _CURRENT = Context(platform=platform.device, device=dev, backend=backend, launcher=launch.launcher,
                       rank=role_rank, world_size=role_world, local_rank=launch.local_rank,
                       local_world_size=launch.local_world_size, layout=layout, cpu_threads=threads, seed=seed,
                       role=role, global_rank=launch.rank, bridge=bridge)
    log.info("platform up: %s", _CURRENT)
    return _CURRENT


def _teardown_partial() -> None:
    global _COMPAT_ACTIVATED_BY_SETUP
    from mrl.platform import parallel as _parallel

    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            _parallel.destroy_model_parallel()
    finally:
        _dist.destroy_process_group()
        if _COMPAT_ACTIVATED_BY_SETUP:
            from mrl.platform import cpu_compat

            cpu_compat.deactivate()
            _COMPAT_ACTIVATED_BY_SETUP = False


def teardown() -> None:
    """Destroy megatron's groups and the process group; deactivate the compat layer if `setup`
    activated it. Idempotent."""
    global _CURRENT
    if _CURRENT is None and not torch.distributed.is_initialized():
        return
    _teardown_partial()
    _CURRENT = None
