"""Two worlds in one launch: ranks that train and ranks that only generate, and the bridge
between them (`rollout.placement = "separate"`).

One `torchrun` (or `srun`) starts `W` ranks. With `R = rollout.ranks`, global ranks
`0 .. W-R-1` train and `W-R .. W-1` generate. Each side gets a default process group of its own
(its "role world", on a key prefix of the job's rendezvous store), so megatron's parallel state
on the trainer side and vLLM's `external_launcher` on the rollout side each see a world made only
of their ranks. Trainer rank 0 is global rank 0, so it stays the rank that owns tracking and
checkpoints.

The sides talk over two groups built on the same store, outside `torch.distributed`'s default
world (process-group objects, used through their own methods):
- `objects`: gloo over every global rank, for pickled messages (rollout batches from the rollout
  leader to trainer rank 0, the trainer's start message).
- `weights`: trainer rank 0 plus every rollout rank (rank 0 of this group is trainer rank 0),
  nccl on CUDA and gloo on CPU, for the bucketed weight stream: one broadcast per bucket.

Every operation runs inside a named `stage`, so a rollout rank that died (the peer closes its
socket) or hangs (the group's timeout) is an error that says which exchange it was.
"""
from __future__ import annotations

import dataclasses
import datetime
import pickle
from typing import Any, Optional

import torch
import torch.distributed as dist

TRAIN, ROLLOUT = "train", "rollout"


@dataclasses.dataclass(frozen=True)
class RoleSplit:
    """Which global ranks train and which generate."""

    world_size: int
    rollout_ranks: int = 0   # 0: every rank does both (colocated)

    @property
    def trainer_ranks(self) -> int:
        return self.world_size - self.rollout_ranks

    @property
    def separate(self) -> bool:
        return self.rollout_ranks > 0

    def role_of(self, rank: int) -> str:
        return ROLLOUT if self.separate and rank >= self.trainer_ranks else TRAIN

    def role_rank(self, rank: int) -> tuple[int, int]:
        """(rank within its role world, size of that world) of global `rank`."""
        if self.role_of(rank) == ROLLOUT:
            return rank - self.trainer_ranks, self.rollout_ranks
        return rank, self.trainer_ranks

    def rollout_global(self, rollout_rank: int) -> int:
        return self.trainer_ranks + rollout_rank


class Bridge:
    """The groups between the trainer's and the rollout's worlds (see the module docstring)."""

    # message tags on the objects group
    TAG_SIZE, TAG_DATA = 1, 2

    def __init__(self, split: RoleSplit, rank: int, store: dist.Store, *, timeout_s: float,
                 weights_backend: str = "gloo", device: Optional[torch.device] = None):
        self.split = split
        self.rank = rank                      # global rank
        self.store = dist.PrefixStore("bridge/live", store)   # heartbeats (mrl.train.liveness)
        self.timeout_s = float(timeout_s)
        self.device = device if weights_backend == "nccl" else torch.device("cpu")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.objects = dist.ProcessGroupGloo(dist.PrefixStore("bridge/objects", store), rank, split.world_size, timeout)
        self.weights = None
        members = [0] + [split.rollout_global(i) for i in range(split.rollout_ranks)]
        if rank in members:
            index = members.index(rank)
            wstore = dist.PrefixStore("bridge/weights", store)
            if weights_backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                self.weights = dist.ProcessGroupNCCL(wstore, index, len(members), opts)
            else:
                self.weights = dist.ProcessGroupGloo(wstore, index, len(members), timeout)

    @property
    def role(self) -> str:
        return self.split.role_of(self.rank)

    @property
    def rollout_leader(self) -> int:
        """Global rank of rollout rank 0: it gathers the rollout side's batches and sends them."""
        return self.split.rollout_global(0)

    # ----------------------------------------------------------------- pickled objects, point to point
    def send_object(self, obj: Any, dst: int, what: str) -> None:
        from mrl.platform.dist import stage

        data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        with stage(f"{what}: send to rank {dst}", self.timeout_s, backend_timeout_s=self.timeout_s):
            self.objects.send([torch.tensor([data.numel()], dtype=torch.int64)], dst, self.TAG_SIZE).wait()
            self.objects.send([data], dst, self.TAG_DATA).wait()

    def recv_object(self, src: int, what: str) -> Any:
        from mrl.platform.dist import stage

        size = torch.zeros(1, dtype=torch.int64)
        with stage(f"{what}: receive from rank {src}", self.timeout_s, backend_timeout_s=self.timeout_s):
            self.objects.recv([size], src, self.TAG_SIZE).wait()
            data = torch.empty(int(size.item()), dtype=torch.uint8)
            self.objects.recv([data], src, self.TAG_DATA).wait()
        return pickle.loads(data.numpy().tobytes())

    # ----------------------------------------------------------------- weights: trainer rank 0 -> rollout ranks
    def broadcast(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """Broadcast one tensor over the weights group from trainer rank 0 (filled there,
        preallocated with the same shape and dtype elsewhere); returns it on this group's device."""
        from mrl.platform.dist import stage

        t = tensor.to(self.device).contiguous()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        with stage(what, self.timeout_s, backend_timeout_s=self.timeout_s):
            self.weights.broadcast([t], opts).wait()
        return t
