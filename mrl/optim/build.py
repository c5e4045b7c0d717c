"""Megatron DDP, optimizer and learning-rate schedule from the `optim` / `schedule` sections.

- `wrap_ddp`: megatron-core `DistributedDataParallel` around each model chunk (contiguous fp32
  gradient buffers, bucketed DP reduction, reduce-scatter with the distributed optimizer).
- `build_optimizer`: `get_megatron_optimizer` (AdamW with decoupled weight decay, or SGD);
  mixed precision (fp32 main params and grads) when the model is bf16, plain fp32 otherwise.
- `build_scheduler`: megatron's `OptimizerParamScheduler` (linear warm-up from 0, then
  constant / linear / cosine decay to `min_lr` over the run's optimizer steps).
"""
from __future__ import annotations

import torch

from mrl.errors import UserError
from mrl.optim.config import OptimConfig, ScheduleConfig

__all__ = ["wrap_ddp", "build_optimizer", "build_scheduler", "warmup_steps"]


def wrap_ddp(chunks: list, *, distributed_optimizer: bool, overlap_grad_reduce: bool = False) -> list:
    """Each model chunk wrapped in megatron's DDP (bucketing only on the first, as Megatron-LM)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap_grad_reduce,
                                               use_distributed_optimizer=distributed_optimizer,
                                               check_for_nan_in_grad=False)
    return [DistributedDataParallel(config=c.config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
            for i, c in enumerate(chunks)]


def build_optimizer(ddp_chunks: list, optim: OptimConfig, *, distributed_optimizer: bool, section: str = "actor"):
    """megatron-core optimizer over the DDP-wrapped chunks. Clipping is applied by `mrl.optim.step`
    (which reports the norm and checks it first), so megatron's own `clip_grad` is switched off."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    if optim.name == "sgd" and distributed_optimizer:
        raise UserError(f"{section}.optim.name = 'sgd' does not work with parallel.distributed_optimizer = true "
                        "(megatron's distributed optimizer is Adam only)")
    dtype = ddp_chunks[0].config.params_dtype
    config = OptimizerConfig(
        optimizer=optim.name, lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
        adam_beta1=optim.beta1, adam_beta2=optim.beta2, adam_eps=optim.eps, clip_grad=0.0,
        use_distributed_optimizer=distributed_optimizer, bf16=dtype is torch.bfloat16, fp16=False,
        params_dtype=dtype, optimizer_cpu_offload=optim.offload,
        optimizer_offload_fraction=1.0 if optim.offload else 0.0)
    optimizer = get_megatron_optimizer(config, ddp_chunks)
    fuse_torch_adam(optimizer)
    return optimizer


def fuse_torch_adam(optimizer) -> int:
    """Switch megatron's fallback `torch.optim.AdamW` to torch's fused CUDA kernel; returns the
    parameter groups switched.

    Without Transformer Engine or apex, megatron-core builds `torch.optim.AdamW` with its default
    `foreach` implementation: on an H200 at the Qwen2.5-1.5B shape that step took 3.7% of the train
    step (tools/bench/train_step.py), a dozen multi-tensor passes over the fp32 state. The fused
    kernel is one pass per parameter chunk. A group is switched only when every parameter in it
    is a floating CUDA tensor (the fused kernel's own condition); CPU (and offloaded) groups keep
    `foreach`, so CPU runs are unchanged."""
    from mrl.optim.step import inner_optimizers

    switched = 0
    for opt in (getattr(o, "optimizer", None) for o in inner_optimizers(optimizer)):
        if not isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in opt.param_groups:
            params = group["params"]
            if params and all(p.is_cuda and p.is_floating_point() for p in params) and not group.get("fused"):
                group["fused"], group["foreach"] = True, False
                switched += 1
    return switched


def warmup_steps(schedule: ScheduleConfig, total_steps: int) -> int:
    """Warm-up length in optimizer steps (`warmup_ratio` of the run wins over `warmup_steps`)."""
    if schedule.warmup_ratio is not None:
        return int(schedule.warmup_ratio * total_steps)
    return schedule.warmup_steps


def build_scheduler(optimizer, optim: OptimConfig, schedule: ScheduleConfig, total_steps: int):
    """megatron's `OptimizerParamScheduler` for `total_steps` optimizer steps of the run.

    lr = `lr * s / warmup` during warm-up (0 at the first step, as verl and Megatron-LM), then
    `schedule.decay` from `lr` to `min_lr` over the remaining steps; weight decay is constant.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warm = warmup_steps(schedule, total_steps)
    decay_steps = max(total_steps, warm + 1)
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warm else optim.lr, max_lr=optim.lr, min_lr=optim.min_lr,
        lr_warmup_steps=warm, lr_decay_steps=decay_steps, lr_decay_style=schedule.decay,
        start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=decay_steps,
        wd_incr_style="constant")
