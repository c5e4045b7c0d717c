"""Save and load a training state: the model with megatron's `dist_checkpointing` (torch_dist
format), the optimizer in mrl's own per-rank format (`mrl.checkpoint.optim_state`).

What a checkpoint holds: every model chunk (sharded tensors, so it loads at another TP/PP/DP
layout), the optimizer (each rank's own shard of its state, with the model-space box and range
of every piece, so it too loads at another layout; fp32 master weights only where they are not
the model's weights), the learning-rate scheduler, the step, an opaque `extra` dict for the
caller (sampler position, KL controller, ...), and per-rank RNG states (python, numpy, torch,
cuda, megatron's tracker). RNG streams are tied to a rank's place in the layout, so they are
restored only when the layout is the one that saved them. Checkpoints of older mrl versions hold
the optimizer in megatron's 'fully_reshardable' torch_dist format; they still load (and
`save(..., optimizer_format="torch_dist")` still writes it, for comparisons).

The torch_dist files are written by threads of the saving process (`mrl.checkpoint.writer`: no
forked writer processes, no manager process), while another thread writes the optimizer's file.
Atomicity and retention are `mrl.checkpoint.store`'s: ranks write into a temporary directory,
rank 0 fsyncs, renames and moves `latest`, then prunes to `keep_last`. Integrity is
`mrl.checkpoint.manifest`'s: the last file of a save lists every other file with its size and
hash (XXH3-128); `verify` checks it before a load, and `find_resumable` skips a damaged newest
checkpoint for the newest intact one, saying in one line what was wrong. Nothing is unpickled
into arbitrary objects: RNG states are tensors and numbers, read with `weights_only=True`;
`common.pt` and torch's `.metadata` are read by `mrl.checkpoint.trust`'s restricted readers
(after the manifest check) before megatron's and torch's readers (plain pickle) see them; the
optimizer's files are raw bytes and JSON, every number checked. Collective: every rank calls
`save`/`load` (`psutil` must be installed or megatron's save hangs).
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import os
import shutil
from pathlib import Path
from typing import Optional

import torch

from mrl.checkpoint import manifest, optim_state, rng, store, trust, writer
from mrl.errors import UserError
from mrl.optim.step import inner_optimizers
from mrl.platform.collectives import broadcast_object, gather_objects

log = logging.getLogger(__name__)

__all__ = ["save", "load", "Loaded", "resolve", "verify", "find_resumable", "estimated_bytes"]


@dataclasses.dataclass(frozen=True)
class Loaded:
    path: Path
    step: int
    extra: dict
    rng_restored: bool
    optimizer_restored: bool = True   # False: the checkpoint had no optimizer state (fresh optimizer)


def _model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


def _layout(with_ranks: bool = True) -> dict:
    """This rank's parallel layout (sizes, and with `with_ranks` its coordinates)."""
    from mrl.platform.parallel import current_layout

    layout = dataclasses.asdict(current_layout()) | {"world": torch.distributed.get_world_size()}
    return layout if with_ranks else {k: v for k, v in layout.items() if not k.endswith("_rank")}


# The optimizer in megatron's torch_dist format (older saves; `optimizer_format="torch_dist"`): the
# distributed optimizer's reshardable format (any TP/PP/DP at load; megatron's own default in
# 0.16.1, 'fully_sharded_model_space', no longer validates). Plain optimizers ignore it.
OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True,
                  # gather the state over the gloo DP group into host memory (no device buffers)
                  "distrib_optim_fully_reshardable_mem_efficient": True}


def _ensure_optimizer_state(optimizer) -> None:
    """Give an optimizer that never stepped its state tensors (Adam moments, step), equal to a fresh
    optimizer's: one step on zero gradients with lr and weight decay 0 (the weights stay, the
    moments stay 0), then every per-parameter `step` back to 0, so the next real update is still
    the first. megatron's distributed optimizer can neither save nor load without this state."""
    for opt in inner_optimizers(optimizer):
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
    for opt in inner_optimizers(optimizer):
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
    for opt in inner_optimizers(optimizer):
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
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (FullyParallelLoadStrategyWrapper,
                                                                            FullyParallelSaveStrategyWrapper)

    if loading:
        return FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(str(path)))
    return FullyParallelSaveStrategyWrapper(writer.save_strategy())


def _barrier() -> None:
    torch.distributed.barrier()


def _world() -> tuple[int, int]:
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def _no_space(e: BaseException) -> bool:
    """Whether `e` (or anything in its chain, or its message: megatron re-raises writer errors
    as text) is 'No space left on device'."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC or "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _disk_full(path: Path, need_bytes: int) -> bool:
    """Whether the filesystem of `path` lacks room for a checkpoint of `need_bytes` (or is all but
    full): megatron's writer processes may report a failed write without its cause, so after a
    failed save the disk itself is asked."""
    try:
        usage = shutil.disk_usage(path if path.exists() else path.parent)
    except OSError:
        return False
    return usage.free < need_bytes or usage.free < min(64 << 20, usage.total // 20)


def _write_manifest(tmp: Path, step: int, has_optimizer: bool, job: Optional[dict] = None) -> None:
    """Hash every file of the finished save (each rank a share) and write the manifest on rank 0."""
    rank, world = _world()
    names = broadcast_object(manifest.listed_files(tmp) if rank == 0 else None, "checkpoint save")
    mine = {rel: manifest.file_entry(tmp / rel) for rel in names[rank::world]}
    everyone = gather_objects(mine, "checkpoint save")
    if rank == 0:
        files = {k: v for part in everyone for k, v in part.items()}
        manifest.write(tmp, files, step=step, optimizer=has_optimizer, job=job)


def save(root: str | Path, step: int, *, chunks: list, optimizer=None, scheduler=None,
         extra: Optional[dict] = None, keep_last: int = 3, job: Optional[dict] = None,
         optimizer_format: str = "mrl") -> Path:
    """Write the checkpoint of `step` under `root` atomically; returns its directory (all ranks).
    `job` (the saving job's identity) goes into the manifest; retention then prunes that job's
    checkpoints only.

    `chunks` are the model's chunks on this rank (DDP-wrapped or bare); `extra` holds plain
    values (numbers, strings, lists, dicts: it is read back with `weights_only=True`) and is
    stored once (rank 0's copy). A full disk is a `UserError` saying so, in one line; the partial
    save is removed. `optimizer_format`: "mrl" (`mrl.checkpoint.optim_state`: each rank writes its
    own shard, no gather; used unless some rank's optimizer is not one it can describe) or
    "torch_dist" (megatron's 'fully_reshardable', as older saves: kept loadable, and for
    comparisons). Collective, inside the stage "checkpoint save".
    """
    from mrl.platform.dist import stage

    root = Path(root)
    tmp = store.tmp_path(root, step)
    with stage("checkpoint save"):
        try:
            return _save(root, tmp, step, chunks=chunks, optimizer=optimizer, scheduler=scheduler, extra=extra,
                         keep_last=keep_last, job=job, optimizer_format=optimizer_format)
        except BaseException as e:   # torch's CheckpointException is a BaseException
            need = estimated_bytes(chunks, with_optimizer=optimizer is not None)
            if isinstance(e, (KeyboardInterrupt, SystemExit)) or not (_no_space(e) or _disk_full(tmp, need)):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                room = _size(shutil.disk_usage(root).free)
            except OSError:
                room = "unknown"
            raise UserError(f"checkpoint save of step {step} to {root}: No space left on device ({room} free, about "
                            f"{_size(need)} needed; the partial save was removed; free space, or lower "
                            "checkpoint.keep_last)") from None


def _optimizer_plan(chunks, optimizer, optimizer_format: str):
    """This rank's pieces of the optimizer state in mrl's format (`optim_state.plan`), or None where
    the torch_dist format is asked for or an optimizer on some rank cannot be described (then every
    rank saves it in megatron's format). Collective."""
    if optimizer is None:
        return None
    if optimizer_format not in ("mrl", "torch_dist"):
        raise ValueError(f"optimizer_format {optimizer_format!r}: 'mrl' or 'torch_dist'")
    pieces, why = None, None
    if optimizer_format == "mrl":
        try:
            pieces = optim_state.plan(chunks, optimizer)
        except optim_state.Unsupported as e:
            why = str(e)
    whys = gather_objects(why if optimizer_format == "mrl" else "asked", "checkpoint save")
    if any(w is not None for w in whys):
        if optimizer_format == "mrl" and torch.distributed.get_rank() == 0:
            log.info("checkpoint: optimizer state saved in megatron's torch_dist format (%s)",
                     next(w for w in whys if w is not None))
        return None
    return pieces


def _save(root: Path, tmp: Path, step: int, *, chunks, optimizer, scheduler, extra, keep_last, job=None,
          optimizer_format: str = "mrl") -> Path:
    import threading

    from megatron.core import dist_checkpointing

    rank = torch.distributed.get_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        store.remove_stale_tmp(root)
        tmp.mkdir(parents=True)  # empty: dist_checkpointing warns about a non-empty target
    _barrier()
    if optimizer is not None:
        _ensure_optimizer_state(optimizer)  # a checkpoint before the first update
    pieces = _optimizer_plan(chunks, optimizer, optimizer_format)
    state = _sharded_state(chunks, optimizer if pieces is None else None, loading=False)
    state["scheduler"] = scheduler.state_dict() if scheduler is not None else None
    state["step"] = step
    state["extra"] = dict(extra or {})
    state["layout"] = _layout(with_ranks=False)
    request = dist_checkpointing.save(state, str(tmp), sharded_strategy=_strategies(tmp, loading=False),
                                      content_metadata=OPTIM_METADATA if pieces is None else None,
                                      async_sharded_save=True)
    failed = []
    if pieces is not None:   # the optimizer's own files, written while megatron writes the model's
        def write():
            try:
                optim_state.write(tmp, pieces, rank)
            except BaseException as e:   # re-raised below, on this rank's main thread
                failed.append(e)
        optim_writer = threading.Thread(target=write, name="mrl-optim-write")
        optim_writer.start()
    try:
        request.execute_sync()
    finally:
        if pieces is not None:
            optim_writer.join()
    if pieces is not None:   # a failed write fails the save on every rank (the others would wait at a barrier)
        said = gather_objects(f"{type(failed[0]).__name__}: {failed[0]}" if failed else None, "checkpoint save")
        if failed:
            raise failed[0]
        bad = [(r, s) for r, s in enumerate(said) if s is not None]
        if bad:
            raise RuntimeError(f"checkpoint save: rank {bad[0][0]} could not write its optimizer state ({bad[0][1]})")
    (tmp / "rng").mkdir(exist_ok=True)
    rng_file = tmp / "rng" / f"rank_{rank:05d}.pt"
    torch.save({"layout": _layout(), "rng": rng.rng_state()}, rng_file)
    with open(rng_file, "rb+") as f:
        os.fsync(f.fileno())
    _barrier()
    _write_manifest(tmp, step, optimizer is not None, job)   # last: a directory without it is incomplete
    _barrier()
    if rank == 0:
        final = store.commit(root, tmp, step)
        removed = store.prune(root, keep_last, owner=job)
        log.info("checkpoint saved: %s (removed %s)", final, [p.name for p in removed])
    _barrier()
    return root / store.step_name(step)


def verify(ckpt: str | Path) -> Optional[str]:
    """What is wrong with the checkpoint directory `ckpt` (its manifest missing or unreadable, a
    file missing, truncated or changed), or None when it is intact. Collective: each rank hashes
    a share of the files; every rank gets the same answer."""
    ckpt = Path(ckpt)
    rank, world = _world()
    try:
        files = manifest.read(ckpt)["files"]
        problem = None
    except (manifest.ManifestError, OSError) as e:
        files, problem = {}, str(e)
    names = sorted(files)
    mine = None if problem else manifest.problem_in(ckpt, {k: files[k] for k in names[rank::world]})
    found = [p for p in gather_objects(problem or mine, "checkpoint load") if p]
    return found[0] if found else None


def estimated_bytes(chunks: list, *, with_optimizer: bool) -> int:
    """About what one checkpoint of `chunks` takes on disk: the weights in their dtype on every
    model-parallel rank (this rank's share x TP x PP), plus with the optimizer two fp32 Adam
    moments per parameter and fp32 master weights for a lower-precision model."""
    from megatron.core import parallel_state as ps

    local = 0
    for c in chunks:
        for p in getattr(c, "module", c).parameters():
            optim = (8 + (4 if p.dtype != torch.float32 else 0)) if with_optimizer else 0
            local += p.numel() * (p.element_size() + optim)
    return local * ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size()


def resolve(path: str | Path) -> Path:
    """A checkpoint directory from a root (its `latest`) or a checkpoint directory itself."""
    path = Path(path)
    if store.step_of(path) is not None and path.is_dir():
        return path
    found = store.latest(path)
    if found is None:
        raise UserError(f"checkpoint: no checkpoint in {path}")
    return found


def _problem_with(ckpt: Path, companions) -> Optional[str]:
    problem = verify(ckpt)
    for other in (companions(ckpt) if companions is not None and problem is None else []):
        problem = verify(other) if Path(other).is_dir() else f"{other} is missing"
        if problem:
            return f"{Path(other).parent.name}/{Path(other).name}: {problem}"
    return problem


def find_resumable(root: str | Path, *, must: bool = False, warn=None, companions=None) -> Optional[Path]:
    """The newest intact checkpoint under `root` (its `latest` first, then the others newest
    first), or None when there is none at all. A damaged newer one is skipped with one line
    naming what was wrong (via `warn`, rank 0) and renamed `<name>.damaged`, so retention and
    later resumes ignore it while it stays on disk for inspection. With `must`, a damaged latest
    checkpoint is an error instead. `root` may also be one checkpoint directory: then it is used
    only if intact. `companions(ckpt)` lists directories that must be intact with it (the
    critic's checkpoint of the same step). Collective, inside the stage "checkpoint load"."""
    from mrl.platform.dist import stage

    root = Path(root)
    warn = warn or log.warning
    with stage("checkpoint load"):
        if store.step_of(root) is not None and root.is_dir():
            problem = _problem_with(root, companions)
            if problem:
                raise UserError(f"checkpoint {root} is damaged: {problem}")
            return root
        first = store.latest(root)
        candidates = ([first] if first else []) + [p for p in reversed(store.checkpoints(root)) if p != first]
        skipped = []
        for ckpt in candidates:
            problem = _problem_with(ckpt, companions)
            if problem is None:
                if skipped and torch.distributed.get_rank() == 0:
                    for bad, why in skipped:
                        warn(f"checkpoint {bad.name} is damaged ({why}); resuming from {ckpt.name} instead "
                             f"(the damaged one is kept as {bad.name}.damaged)")
                        aside = bad.with_name(bad.name + ".damaged")
                        shutil.rmtree(aside, ignore_errors=True)   # an older damaged copy of the same step
                        os.replace(bad, aside)
                    store.write_latest(root, ckpt.name)
                _barrier()
                return ckpt
            if must:
                raise UserError(f"checkpoint.resume = 'must': the latest checkpoint {ckpt} is damaged: {problem}")
            skipped.append((ckpt, problem))
        if skipped:
            listing = "; ".join(f"{p.name}: {why}" for p, why in skipped)
            raise UserError(f"checkpoint: no intact checkpoint in {root} ({listing}); set checkpoint.resume = 'never' "
                            "to start over")
        return None


_SAID_NO_OPTIMIZER: set[str] = set()


def load(path: str | Path, *, chunks: list, optimizer=None, scheduler=None, load_rng: bool = True,
         verified: bool = False) -> Loaded:
    """Load a checkpoint (a root's latest, or a step directory) into this rank's shards, at any
    TP/PP/DP layout. The checkpoint is checked against its manifest first (unless `verified`:
    the caller just did). A checkpoint saved without optimizer state (`checkpoint.save_optimizer
    = false`) leaves `optimizer` fresh, said once. Collective, inside the stage "checkpoint load"."""
    from megatron.core import dist_checkpointing

    from mrl.platform.dist import stage

    ckpt = resolve(path)
    with stage("checkpoint load"):
        if not verified:
            problem = verify(ckpt)
            if problem:
                raise UserError(f"checkpoint {ckpt} is damaged: {problem}")
        has_optimizer = bool(manifest.read(ckpt).get("optimizer", True))
        if optimizer is not None and not has_optimizer:
            if torch.distributed.get_rank() == 0 and str(ckpt) not in _SAID_NO_OPTIMIZER:
                _SAID_NO_OPTIMIZER.add(str(ckpt))
                log.warning("checkpoint %s holds no optimizer state (saved with checkpoint.save_optimizer = false): "
                            "the optimizer starts fresh", ckpt)
            optimizer = None
        if optimizer is not None:
            _ensure_optimizer_state(optimizer)
        trust.read_dcp_metadata(ckpt)   # both pickles through restricted readers before megatron/torch see them
        trust.read_common(ckpt)
        own_format = optim_state.present(ckpt)   # else megatron's, in the torch_dist files (older saves)
        state = _sharded_state(chunks, None if own_format else optimizer, loading=True)  # common entries: the file's
        loaded = dist_checkpointing.load(state, str(ckpt), sharded_strategy=_strategies(ckpt, loading=True))
        for i, c in enumerate(chunks):
            module = getattr(c, "module", c)
            missing, unexpected = module.load_state_dict(loaded[_model_key(i, len(chunks))], strict=False)
            missing = [k for k in missing if not k.endswith("_extra_state")]
            if missing or unexpected:
                raise UserError(f"checkpoint {ckpt}: model does not match (missing {missing[:3]}, unexpected {unexpected[:3]})")
        if optimizer is not None and own_format:
            _unshare_steps(optimizer)
            optim_state.load(ckpt, chunks, optimizer)
        elif optimizer is not None:
            _load_optimizer(optimizer, loaded["optimizer"])
        if scheduler is not None and loaded.get("scheduler") is not None:
            scheduler.num_steps = 0  # megatron's load *adds* the saved steps (it assumes a fresh scheduler)
            scheduler.load_state_dict(loaded["scheduler"])
        restored = False
        if load_rng:
            rng_file = ckpt / "rng" / f"rank_{torch.distributed.get_rank():05d}.pt"
            if rng_file.is_file():
                saved = rng.read_rng_file(rng_file, ckpt)
                if saved["layout"] == _layout():
                    rng.set_rng_state(saved["rng"])
                    restored = True
            if not restored:
                log.info("checkpoint %s: parallel layout differs from the saving one; RNG states not restored", ckpt)
    return Loaded(path=ckpt, step=int(loaded["step"]), extra=dict(loaded.get("extra") or {}), rng_restored=restored,
                  optimizer_restored=optimizer is not None)
