"""megatron-core model parallelism from the job's `parallel` section: groups, RNG, teardown."""
from __future__ import annotations

import dataclasses

import torch

from mrl.errors import UserError
from mrl.platform.config import ParallelConfig


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """Sizes and this rank's coordinates in megatron's process grid."""

    tp: int
    pp: int
    vpp: int | None
    cp: int
    ep: int
    etp: int
    dp: int
    tp_rank: int
    pp_rank: int
    cp_rank: int
    ep_rank: int
    dp_rank: int


def check_layout(cfg: ParallelConfig, world_size: int, device: str) -> None:
    """Raise `UserError` for a layout megatron would reject, naming the `parallel.*` keys."""
    model = cfg.tensor * cfg.pipeline * cfg.context
    if world_size % model:
        raise UserError(
            f"world size {world_size} is not divisible by parallel.tensor x parallel.pipeline x parallel.context "
            f"= {cfg.tensor} x {cfg.pipeline} x {cfg.context} = {model}"
        )
    etp = cfg.expert_tensor if cfg.expert_tensor is not None else cfg.tensor
    expert_model = etp * cfg.expert * cfg.pipeline
    if world_size % expert_model:
        raise UserError(
            f"world size {world_size} is not divisible by parallel.expert_tensor x parallel.expert x parallel.pipeline "
            f"= {etp} x {cfg.expert} x {cfg.pipeline} = {expert_model}"
        )
    if cfg.virtual_pipeline is not None and cfg.pipeline < 2:
        raise UserError("parallel.virtual_pipeline needs parallel.pipeline >= 2")
    if cfg.sequence_parallel and cfg.tensor < 2:
        raise UserError("parallel.sequence_parallel needs parallel.tensor >= 2")
    if cfg.sequence_parallel and device == "cpu":
        raise UserError(
            "parallel.sequence_parallel is not available on the cpu platform: it needs the Transformer Engine "
            "or apex norm layers (megatron's torch norm refuses it); set parallel.sequence_parallel = false"
        )


def initialize_model_parallel(cfg: ParallelConfig, *, collective_timeout_s: float) -> ParallelLayout:
    """Create megatron's TP/PP/CP/EP/DP process groups for `cfg` on the already-initialized world.

    Megatron's groups get the job's collective timeout too (`distributed_timeout_minutes`, which
    0.16.1 turns into `timedelta(minutes=...)`, so fractional minutes keep second precision).
    """
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        raise RuntimeError("megatron model parallel state is already initialized; call teardown first")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tensor,
        pipeline_model_parallel_size=cfg.pipeline,
        virtual_pipeline_model_parallel_size=cfg.virtual_pipeline,
        context_parallel_size=cfg.context,
        expert_model_parallel_size=cfg.expert,
        expert_tensor_parallel_size=cfg.expert_tensor,
        distributed_timeout_minutes=collective_timeout_s / 60.0,
    )
    return current_layout()


def current_layout() -> ParallelLayout:
    """This rank's `ParallelLayout` from megatron's initialized parallel state."""
    from megatron.core import parallel_state as ps

    return ParallelLayout(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
    )


def seed_model_parallel(seed: int, device: str) -> None:
    """Seed every RNG the way megatron expects: the default generator with `seed` and the tracked
    tensor-/expert-parallel streams offset by TP/EP rank (see `model_parallel_cuda_manual_seed`).

    On cuda this is megatron's own function; on cpu the compat layer's CPU-generator twin.
    """
    seed_process(seed)
    if device == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    else:
        from mrl.platform.cpu_rng import cpu_model_parallel_manual_seed

        cpu_model_parallel_manual_seed(seed)


def seed_process(seed: int) -> None:
    """Seed the process-wide RNGs (Python, numpy, torch's default generator); all a rank without
    megatron's groups (a rollout-only rank) needs."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def destroy_model_parallel() -> None:
    """Tear down megatron's parallel state and RNG tracker (idempotent)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    ps.destroy_model_parallel()
    mrandom._CUDA_RNG_STATE_TRACKER = None
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False

