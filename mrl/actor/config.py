"""The `actor` section: how the policy is updated (batching, epochs, optimizer, schedule)."""
from __future__ import annotations

from typing import Literal, Optional

from mrl.config.schema import option, section
from mrl.models.lora import LoraConfig
from mrl.optim.config import OptimConfig, ScheduleConfig


@section
class ActorConfig:
    """Policy update. A step's responses are split into mini-batches (one optimizer step each),
    and each rank's share of a mini-batch into token-balanced micro-batches."""

    mini_batch_prompts: Optional[int] = option(None, ge=1, help="prompts per optimizer step (default: data.prompts_per_step); all their responses go in")
    micro_batch_tokens: int = option(16384, ge=1, help="token budget of one micro-batch on one rank (forward/backward)")
    logprob_micro_batch_tokens: Optional[int] = option(None, ge=1, help="token budget for log-prob-only passes (default: micro_batch_tokens)")
    epochs: int = option(1, ge=1, help="passes over each step's data (verl: ppo_epochs)")
    shuffle: bool = option(False, help="shuffle responses between epochs")
    recompute: Literal["none", "selective", "full"] = option("none", help="activation recomputation")
    optim: OptimConfig = option(factory=OptimConfig, help="optimizer")
    schedule: ScheduleConfig = option(factory=ScheduleConfig, help="learning-rate schedule")
    lora: LoraConfig = option(factory=LoraConfig, help="LoRA adapters (rank 0 = full fine-tuning); with adapters "
                              "the reference model is the base with adapters off")
