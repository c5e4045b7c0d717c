"""The `reward` section: how responses are scored. Exactly one source is set."""
from __future__ import annotations

from typing import Any, Literal, Optional

from mrl.config.schema import option, section


@section
class RewardConfig:
    """A user function `file.py:function`, a builtin rule verifier, or a reward model."""

    function: Optional[str] = option(None, help="'path/to/file.py:function' or 'module:function'; score(prompt, response, ground_truth, extra) -> float | dict")
    builtin: Optional[Literal["exact_match", "math", "reasoning_gym"]] = option(None, help="builtin rule verifier")
    model_path: Optional[str] = option(None, help="reward model checkpoint (scalar head)")
    score_key: str = option("score", help="key of the score when the function returns a dict")
    kwargs: dict[str, Any] = option(factory=dict, help="extra keyword arguments passed to the function")
    workers: int = option(4, ge=1, help="reward processes (functions run isolated, in a pool)")
    timeout_s: float = option(30.0, gt=0, help="a call that takes longer is killed and scored on_error")
    on_error: Literal["zero", "fail"] = option("zero", help="a crashing or hanging call scores 0 (and is counted), or fails the step")
    micro_batch_tokens: Optional[int] = option(None, ge=1, help="reward model token budget per forward")
