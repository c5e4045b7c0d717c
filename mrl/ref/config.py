"""The `ref` section: the frozen reference policy for KL."""
from __future__ import annotations

from typing import Optional

from mrl.config.schema import option, section


@section
class RefConfig:
    """Frozen reference model; needed when a KL term is on."""

    enable: Optional[bool] = option(None, help="default: on exactly when algorithm.kl_loss or algorithm.kl_reward is on")
    model_path: Optional[str] = option(None, help="checkpoint (default: model.path)")
    micro_batch_tokens: Optional[int] = option(None, ge=1, help="token budget per forward (default: actor.micro_batch_tokens)")
