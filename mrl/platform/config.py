"""The `platform` and `parallel` sections: where a job runs and how its models are split."""
from __future__ import annotations

from typing import Literal, Optional

from mrl.schema.section import option, section


@section
class PlatformConfig:
    """Hardware and process layout. World size = nodes x ranks_per_node."""

    device: Literal["cuda", "cpu"] = option("cuda", help="cuda for GPU clusters; cpu for the development platform")
    nodes: int = option(1, ge=1, help="number of nodes")
    ranks_per_node: int = option(8, ge=1, help="processes per node: GPUs on cuda, CPU ranks on cpu")
    backend: Literal["auto", "nccl", "gloo"] = option("auto", help="process-group backend; auto = nccl on cuda, gloo on cpu")
    collective_timeout_s: float = option(1800.0, gt=0, help="a collective that takes longer fails, naming the stage")
    init_timeout_s: float = option(300.0, gt=0, help="how long rendezvous and process-group set-up may take")
    cpu_threads: Optional[int] = option(None, ge=1, help="torch intra-op threads per rank on cpu (default: cores / ranks)")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


@section
class ParallelConfig:
    """Megatron parallel layout of the trained models. DP = world / (tensor x pipeline x context)."""

    tensor: int = option(1, ge=1, help="tensor-parallel size (TP)")
    pipeline: int = option(1, ge=1, help="pipeline-parallel size (PP)")
    virtual_pipeline: Optional[int] = option(None, ge=1, help="virtual pipeline stages per PP rank (interleaved schedule)")
    context: int = option(1, ge=1, help="context-parallel size (CP): each packed sequence in 2 x CP chunks, two per rank; "
                                           "micro-batch token budgets are per rank")
    expert: int = option(1, ge=1, help="expert-parallel size (EP) inside MoE layers")
    expert_tensor: Optional[int] = option(None, ge=1, help="tensor-parallel size of expert layers (default: tensor)")
    sequence_parallel: bool = option(False, help="Megatron sequence parallelism (needs TP > 1 and TE/apex norms)")
    distributed_optimizer: bool = option(True, help="shard optimizer state across DP ranks")

    def data_parallel(self, world_size: int) -> int:
        return world_size // (self.tensor * self.pipeline * self.context)
