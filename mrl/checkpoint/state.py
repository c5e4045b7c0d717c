"""Save and load a training state with megatron's `dist_checkpointing` (torch_dist format).

What a checkpoint holds: every model chunk (sharded tensors, so it loads at another TP/PP/DP
layout), the optimizer (megatron's reshardable formats), the learning-rate scheduler, the step,
an opaque `extra` dict for the caller (sampler position, KL controller, ...), and per-rank RNG
states (python, numpy, torch, cuda, megatron's tracker). RNG streams are tied to a rank's place
in the layout, so they are restored only when the layout is the one that saved them.

Atomicity and retention are `mrl.checkpoint.store`'s: ranks write into a temporary directory,
rank 0 fsyncs, renames and moves `latest`, then prunes to `keep_last`. Collective: every rank
calls `save`/`load` (torch_dist saving starts a helper process: scripts need a `__main__` guard,
and `psutil` must be installed or the save hangs).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import random
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from mrl.checkpoint import store
from mrl.errors import UserError

log = logging.getLogger(__name__)

__all__ = ["save", "load", "Loaded", "resolve"]


@dataclasses.dataclass(frozen=True)
class Loaded:
    path: Path
    step: int
    extra: dict
    rng_restored: bool


def _model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


def _layout(with_ranks: bool = True) -> dict:
    """This rank's parallel layout (sizes, and with `with_ranks` its coordinates)."""
    from mrl.platform.parallel import current_layout

    layout = dataclasses.asdict(current_layout()) | {"world": torch.distributed.get_world_size()}
    return layout if with_ranks else {k: v for k, v in layout.items() if not k.endswith("_rank")}


# The distributed optimizer's reshardable format (any TP/PP/DP at load; megatron's own default in
# 0.16.1, 'fully_sharded_model_space', no longer validates). Plain optimizers ignore it.
OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True,
                  # gather the state over the gloo DP group into host memory (no device buffers)
                  "distrib_optim_fully_reshardable_mem_efficient": True}


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _ensure_optimizer_state(optimizer) -> None:
    """Give an optimizer that never stepped its state tensors (Adam moments, step), equal to a fresh
    optimizer's: one step on zero gradients with lr and weight decay 0 (the weights stay, the
    moments stay 0), then every per-parameter `step` back to 0, so the next real update is still
    the first. megatron's distributed optimizer can neither save nor load without this state."""
    for opt in _inner_optimizers(optimizer):
        inner = opt.optimizer
        if inner is None or len(inner.state) > 0:
            continue
        saved = [(g["lr"], g["weight_decay"]) for g in inner.param_groups]
        for g in inner.param_groups:
            g["lr"], g["weight_decay"] = 0.0, 0.0
            for p in g["params"]:
                if p.numel():
                    p.grad = torch.zeros_like(p)
        inner.step()
        inner.zero_grad()
        for g, (lr, wd) in zip(inner.param_groups, saved):
            g["lr"], g["weight_decay"] = lr, wd
        for st in inner.state.values():
            if torch.is_tensor(st.get("step")):
                st["step"].zero_()


def _unshare_steps(optimizer) -> None:
    """Give every parameter its own Adam `step` tensor.

    megatron-core 0.16.1's distributed optimizer with torch's Adam (no Apex/TE) restores the step
    from the param groups as *one* tensor assigned to every parameter's state; torch's Adam then
    increments it in place once per parameter, so after the first resumed update the step is
    `saved + number of parameters` instead of `saved + 1` and every parameter gets the wrong bias
    correction."""
    for opt in _inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        seen: set[int] = set()
        for st in inner.state.values():
            step = st.get("step")
            if torch.is_tensor(step):
                if id(step) in seen:
                    st["step"] = step.clone()
                seen.add(id(step))


def _load_optimizer(optimizer, state: dict) -> None:
    """`optimizer.load_state_dict`, working around megatron-core 0.16.1's distributed optimizer with
    torch's Adam (no Apex/TE): its reshardable load copies every per-parameter state key, but the
    checkpoint (rightly) has no per-parameter 'step' (restored from the param groups instead), so
    the copy fails on 'step'. While loading, each main param's 'step' is set aside around that
    copy. With TE's FusedAdam there is no per-parameter step and this changes nothing."""
    patched = []
    for opt in _inner_optimizers(optimizer):
        if not hasattr(opt, "_set_main_param_and_optimizer_states"):
            continue

        def set_states(model_param, tensors, _opt=opt, _orig=opt._set_main_param_and_optimizer_states):
            group, order = _opt.model_param_group_index_map[model_param]
            st = _opt.optimizer.state[_opt.optimizer.param_groups[group]["params"][order]]
            step = st.pop("step", None) if "step" not in tensors else None
            try:
                _orig(model_param, tensors)
            finally:
                if step is not None:
                    st["step"] = step

        opt._set_main_param_and_optimizer_states = set_states
        patched.append(opt)
    try:
        optimizer.load_state_dict(state)
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states
    _unshare_steps(optimizer)


def _sharded_state(chunks, optimizer, loading: bool) -> dict:
    # the bare modules (not DDP), so keys are the same for trained and frozen models
    state = {_model_key(i, len(chunks)): getattr(c, "module", c).sharded_state_dict() for i, c in enumerate(chunks)}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=loading, metadata=OPTIM_METADATA)
    return state


def _strategies(path: Path, loading: bool):
    from megatron.core.dist_checkpointing.serialization import (get_default_load_sharded_strategy,
                                                                get_default_save_sharded_strategy)
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (FullyParallelLoadStrategyWrapper,
                                                                            FullyParallelSaveStrategyWrapper)

    if loading:
        return FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(str(path)))
    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"))


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _barrier() -> None:
    torch.distributed.barrier()


def save(root: str | Path, step: int, *, chunks: list, optimizer=None, scheduler=None,
         extra: Optional[dict] = None, keep_last: int = 3) -> Path:
    """Write the checkpoint of `step` under `root` atomically; returns its directory (all ranks).

    `chunks` are the model's chunks on this rank (DDP-wrapped or bare); `extra` must be
    picklable and is stored once (rank 0's copy).
    """
    from megatron.core import dist_checkpointing

    root = Path(root)
    rank = torch.distributed.get_rank()
    tmp = store.tmp_path(root, step)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        store.remove_stale_tmp(root)
        tmp.mkdir(parents=True)  # empty: dist_checkpointing warns about a non-empty target
    _barrier()
    if optimizer is not None:
        _ensure_optimizer_state(optimizer)  # a checkpoint before the first update
    state = _sharded_state(chunks, optimizer, loading=False)
    state["scheduler"] = scheduler.state_dict() if scheduler is not None else None
    state["step"] = step
    state["extra"] = dict(extra or {})
    state["layout"] = _layout(with_ranks=False)
    dist_checkpointing.save(state, str(tmp), sharded_strategy=_strategies(tmp, loading=False),
                            content_metadata=OPTIM_METADATA)
    (tmp / "rng").mkdir(exist_ok=True)
    rng_file = tmp / "rng" / f"rank_{rank:05d}.pt"
    torch.save({"layout": _layout(), "rng": _rng_state()}, rng_file)
    with open(rng_file, "rb+") as f:
        os.fsync(f.fileno())
    _barrier()
    if rank == 0:
        final = store.commit(root, tmp, step)
        removed = store.prune(root, keep_last)
        log.info("checkpoint saved: %s (removed %s)", final, [p.name for p in removed])
    _barrier()
    return root / store.step_name(step)


def resolve(path: str | Path) -> Path:
    """A checkpoint directory from a root (its `latest`) or a checkpoint directory itself."""
    path = Path(path)
    if store.step_of(path) is not None and path.is_dir():
        return path
    found = store.latest(path)
    if found is None:
        raise UserError(f"checkpoint: no checkpoint in {path}")
    return found


def load(path: str | Path, *, chunks: list, optimizer=None, scheduler=None, load_rng: bool = True) -> Loaded:
    """Load a checkpoint (a root's latest, or a step directory) into this rank's shards, at any
    TP/PP/DP layout. Collective."""
    from megatron.core import dist_checkpointing

    ckpt = resolve(path)
    if optimizer is not None:
        _ensure_optimizer_state(optimizer)
    state = _sharded_state(chunks, optimizer, loading=True)  # common entries come back from the file
    loaded = dist_checkpointing.load(state, str(ckpt), sharded_strategy=_strategies(ckpt, loading=True))
    for i, c in enumerate(chunks):
        module = getattr(c, "module", c)
        missing, unexpected = module.load_state_dict(loaded[_model_key(i, len(chunks))], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise UserError(f"checkpoint {ckpt}: model does not match (missing {missing[:3]}, unexpected {unexpected[:3]})")
    if optimizer is not None:
        _load_optimizer(optimizer, loaded["optimizer"])
    if scheduler is not None and loaded.get("scheduler") is not None:
        scheduler.num_steps = 0  # megatron's load *adds* the saved steps (it assumes a fresh scheduler)
        scheduler.load_state_dict(loaded["scheduler"])
    restored = False
    if load_rng:
        rng_file = ckpt / "rng" / f"rank_{torch.distributed.get_rank():05d}.pt"
        if rng_file.is_file():
            saved = torch.load(rng_file, weights_only=False)
            if saved["layout"] == _layout():
                _set_rng_state(saved["rng"])
                restored = True
        if not restored:
            log.info("checkpoint %s: parallel layout differs from the saving one; RNG states not restored", ckpt)
    return Loaded(path=ckpt, step=int(loaded["step"]), extra=dict(loaded.get("extra") or {}), rng_restored=restored)
