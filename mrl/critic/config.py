"""The `critic` section: the value model for GAE (PPO)."""
from __future__ import annotations

from typing import Literal, Optional

from mrl.config.schema import option, section
from mrl.optim.config import OptimConfig, ScheduleConfig


def _critic_optim() -> OptimConfig:
    return OptimConfig(lr=1e-5)


@section
class CriticConfig:
    """Value model trained alongside the actor; needed by the gae estimator."""

    enable: Optional[bool] = option(None, help="default: on exactly when algorithm.advantage = 'gae'")
    model_path: Optional[str] = option(None, help="initial checkpoint (default: model.path; the LM head is replaced by a value head)")
    mini_batch_prompts: Optional[int] = option(None, ge=1, help="prompts per critic optimizer step (default: actor.mini_batch_prompts)")
    micro_batch_tokens: int = option(16384, ge=1, help="token budget of one micro-batch on one rank")
    epochs: int = option(1, ge=1, help="passes over each step's data")
    warmup_steps: int = option(0, ge=0, help="train only the critic for this many steps first")
    recompute: Literal["none", "selective", "full"] = option("none", help="activation recomputation")
    optim: OptimConfig = option(factory=_critic_optim, help="optimizer")
    schedule: ScheduleConfig = option(factory=ScheduleConfig, help="learning-rate schedule")
