"""The collectives the RL and SFT loops run, in one module, each inside a named stage.

Every function here runs its collective inside `mrl.platform.dist.stage(name)`, so a peer that
never arrives is a `CollectiveTimeout` naming the stage after `platform.collective_timeout_s`
(the rule of `mrl.platform.dist`), never a silent hang. Callers pass what the collective is for
(`name`); the stage names are what a timeout reports. On one rank (or before the process group
exists) each is the identity, so stage code runs unchanged in unit tests.

Groups:
- "data-parallel": megatron's data-parallel group of the trainer (`dp_*`);
- the default group: every rank of this role's world (`world_*`, `broadcast_object`,
  `gather_objects`; with a separate placement each role has a world of its own);
- a leader's group (`from_leader`): the model-parallel group of a colocated rollout, or an
  engine group of a separate one, whose first rank generates and scores.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from mrl.platform.dist import stage, wait_for_peers

_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def _multi(group=None) -> bool:
    return dist.is_initialized() and dist.get_world_size(group) > 1


def _dp_group():
    """Megatron's data-parallel group, or None where there is none (one rank, rollout ranks)."""
    if not dist.is_initialized():
        return None
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_data_parallel_world_size() == 1:
        return None
    return ps.get_data_parallel_group()


def dp_all_reduce(t: torch.Tensor, name: str, op: str = "sum") -> torch.Tensor:
    """`t` reduced (`op`: sum | min | max) over the trainer's data-parallel ranks, in place when
    `t` is contiguous; returns the reduced tensor."""
    group = _dp_group()
    if group is None:
        return t
    t = t.contiguous()
    with stage(name):
        dist.all_reduce(t, op=_OPS[op], group=group)
    return t


def dp_sum(t: torch.Tensor, name: str = "data-parallel statistics") -> torch.Tensor:
    """A summed copy of `t` over the data-parallel ranks (`t` is left as it is): the `all_reduce`
    that `mrl.algos` functions take for statistics spanning DP."""
    return dp_all_reduce(t.clone(), name)


def dp_min(count: int, name: str = "data-parallel agreement") -> int:
    """The minimum of an integer count over the data-parallel ranks."""
    return int(dp_all_reduce(torch.tensor([float(count)]), name, op="min").item())


def world_reduce(t: torch.Tensor, name: str, op: str = "sum") -> torch.Tensor:
    """`t` reduced over every rank of this role's world (in place when contiguous)."""
    if not _multi():
        return t
    t = t.contiguous()
    with stage(name):
        dist.all_reduce(t, op=_OPS[op])
    return t


def world_min(count: int, name: str) -> int:
    """The minimum of an integer count over this role's world."""
    return int(world_reduce(torch.tensor([float(count)]), name, op="min").item())


def world_max(value: float, name: str) -> float:
    """The maximum of `value` over this role's world (a stage's time is its slowest rank's)."""
    return float(world_reduce(torch.tensor([float(value)], dtype=torch.float64), name, op="max").item())


def world_any(flag: bool, name: str) -> bool:
    """True on every rank of this role's world when `flag` is True on any rank (on the device the
    backend needs: CUDA for nccl)."""
    if not _multi():
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    if dist.get_backend() == "nccl":
        t = t.cuda()
    return bool(world_reduce(t, name, op="max").item() > 0)


def broadcast_object(obj: Any, name: str, src: int = 0) -> Any:
    """Rank `src`'s `obj` (picklable) on every rank of this role's world."""
    if not _multi():
        return obj
    box = [obj]
    with stage(name):
        dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj: Any, name: str, group=None) -> list:
    """Every rank's `obj`, in rank order, on every rank of `group` (default: this role's world)."""
    if not _multi(group):
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    with stage(name):
        dist.all_gather_object(out, obj, group=group)
    return out


def from_leader(obj: Any, group: Optional["dist.ProcessGroup"], is_leader: bool, work: str) -> Any:
    """`obj` from `group`'s first rank (the leader that generated or scored it) to every rank of
    the group.

    First every rank waits until all leaders finished `work` (generation, reward scoring), in the
    stage `work` whose timeout covers that work's own bound (`mrl.platform.dist.wait_for_peers`):
    a slow but correct leader never trips the collective timeout of a rank waiting for it."""
    wait_for_peers(work)
    if group is None or not _multi(group):
        return obj
    box = [obj if is_leader else None]
    with stage(f"{work} results"):
        dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


__all__ = ["dp_all_reduce", "dp_sum", "dp_min", "world_reduce", "world_min", "world_max", "world_any", "broadcast_object",
           "gather_objects", "from_leader"]
