"""The `optim` and `schedule` sub-sections shared by the actor and the critic."""
from __future__ import annotations

from typing import Literal, Optional

from mrl.schema.section import option, section


@section
class OptimConfig:
    """Megatron optimizer settings."""

    name: Literal["adam", "sgd"] = option("adam", help="optimizer (adam = AdamW with decoupled weight decay)")
    lr: float = option(1e-6, gt=0, help="peak learning rate")
    min_lr: float = option(0.0, ge=0, help="floor of the decayed learning rate")
    weight_decay: float = option(0.01, ge=0, help="decoupled weight decay")
    beta1: float = option(0.9, ge=0, lt=1, help="Adam beta1")
    beta2: float = option(0.999, ge=0, lt=1, help="Adam beta2")
    eps: float = option(1e-8, gt=0, help="Adam epsilon")
    grad_clip: float = option(1.0, ge=0, help="global gradient-norm clip; 0 disables")
    offload: bool = option(False, help="keep optimizer state on the host between updates")
    nonfinite: Literal["stop", "skip"] = option(
        "stop", help="a NaN/inf loss or gradient norm: stop the run (naming step and stage) or skip that update")


@section
class ScheduleConfig:
    """Learning-rate schedule, counted in optimizer steps."""

    warmup_steps: int = option(0, ge=0, help="linear warm-up steps")
    warmup_ratio: Optional[float] = option(None, ge=0, lt=1, help="warm-up as a fraction of all optimizer steps (instead of warmup_steps)")
    decay: Literal["constant", "linear", "cosine"] = option("constant", help="shape after warm-up")
