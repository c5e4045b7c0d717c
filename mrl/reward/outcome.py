"""Turn what a reward function returned into a score plus metrics, or name what is wrong with it.

A function returns a number, or a dict whose `score_key` entry is the reward and whose other
numeric entries are metrics to log (non-numeric entries are ignored). NaN, infinity and
non-numbers are errors, counted and scored by `reward.on_error` like exceptions and timeouts.
"""
from __future__ import annotations

import math
import numbers
from typing import Any


class BadScore(ValueError):
    """A reward value that is not a finite number; `kind` is the counter it goes to."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _number(value: Any) -> float | None:
    if isinstance(value, numbers.Real):
        return float(value)
    if getattr(value, "shape", None) == () and hasattr(value, "item"):  # 0-d numpy / torch
        item = value.item()
        return float(item) if isinstance(item, numbers.Real) else None
    return None


def read_score(value: Any, score_key: str = "score") -> tuple[float, dict[str, float]]:
    """(score, metrics) from a function's return value; raises `BadScore` ("non_finite", "not_a_number",
    "missing_score_key")."""
    metrics: dict[str, float] = {}
    raw = value
    if isinstance(value, dict):
        if score_key not in value:
            raise BadScore("missing_score_key", f"returned a dict without {score_key!r} (reward.score_key); keys: "
                                                f"{', '.join(map(str, value))}")
        raw = value[score_key]
        for k, v in value.items():
            number = _number(v) if k != score_key else None
            if number is not None and math.isfinite(number):
                metrics[str(k)] = number
    score = _number(raw)
    if score is None:
        raise BadScore("not_a_number", f"returned {type(raw).__name__} {str(raw)[:80]!r}, not a number")
    if not math.isfinite(score):
        raise BadScore("non_finite", f"returned {score}")
    return score, metrics
