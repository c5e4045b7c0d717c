"""megatron's RNG-states tracker on the CPU generator (rows 8 and 9 of `cpu_compat`'s table).

`cpu_model_parallel_manual_seed` is the CPU twin of megatron's `model_parallel_cuda_manual_seed`:
the same named streams (data-parallel, tensor-parallel, expert) and seed layout, each a state of
torch's CPU generator; `cpu_get_rng_state` / `cpu_set_rng_state` stand in for megatron's CUDA
generator state (activation recompute). `cpu_compat.activate()` installs them.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from mrl.errors import UserError


def _tracker_base():
    from megatron.core.tensor_parallel import random as mrandom

    return mrandom.CudaRNGStatesTracker


class _CpuTrackerMixin:
    """RNG-states tracker on the CPU generator: megatron's named streams (data-parallel,
    tensor-parallel, expert) with the same `add`/`fork` contract as `CudaRNGStatesTracker`."""

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig_state = torch.get_rng_state()
        orig_name = self._current_state_name
        if orig_name != "default-rng":
            self.states_[orig_name] = orig_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if orig_name != "default-rng":
                orig_state = self.states_[orig_name]
            torch.set_rng_state(orig_state)
            self._current_state_name = orig_name


_TRACKER_CLS = None


def cpu_rng_tracker_class():
    """`CpuRNGStatesTracker`: a subclass of megatron's tracker on the CPU generator."""
    global _TRACKER_CLS
    if _TRACKER_CLS is None:
        _TRACKER_CLS = type("CpuRNGStatesTracker", (_CpuTrackerMixin, _tracker_base()), {})
    return _TRACKER_CLS


def cpu_model_parallel_manual_seed(seed: int, te_rng_tracker: bool = False, inference_rng_tracker: bool = False,
                                   use_cudagraphable_rng: bool = False, tp_rank: Optional[int] = None,
                                   ep_rank: Optional[int] = None, etp_rank: Optional[int] = None,
                                   force_reset_rng: bool = False) -> None:
    """CPU twin of `model_parallel_cuda_manual_seed` (same signature and seed layout)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    if te_rng_tracker or use_cudagraphable_rng:
        raise UserError("the cpu platform has no Transformer Engine or CUDA-graph RNG tracker")
    tp_rank = ps.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    ep_rank = ps.get_expert_model_parallel_rank() if ep_rank is None else ep_rank
    etp_rank = ps.get_expert_tensor_parallel_rank() if etp_rank is None else etp_rank
    if inference_rng_tracker:
        mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    else:
        mrandom._CUDA_RNG_STATE_TRACKER = cpu_rng_tracker_class()()
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)


def cpu_get_rng_state(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()  # already a copy


def cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)
