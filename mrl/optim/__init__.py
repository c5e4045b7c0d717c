"""mrl.optim: megatron DDP, optimizer, learning-rate schedule and the guarded update step."""
from mrl.optim.build import build_optimizer, build_scheduler, warmup_steps, wrap_ddp
from mrl.optim.step import NonFiniteError, StepOutcome, guarded_step

__all__ = ["wrap_ddp", "build_optimizer", "build_scheduler", "warmup_steps", "guarded_step", "StepOutcome",
           "NonFiniteError"]
