"""Turn what a reward function returned into a score plus metrics, or name what is wrong with it.

A function returns a number, or a dict whose `score_key` entry is the reward and whose other
numeric entries are metrics to log (non-numeric entries are ignored). Scores enter the trainer
as float32, so a score must be a finite float32: NaN and infinity ("non_finite"), numbers beyond
float32's range such as 1e39 or 10**400 ("out_of_range") and non-numbers ("not_a_number") are
errors, counted by kind and scored by `reward.on_error` like exceptions and timeouts.
"""
from __future__ import annotations

import math
import numbers
from typing import Any


FLOAT32_MAX = 3.4028234663852886e38


class BadScore(ValueError):
    """A reward value that is not a finite number; `kind` is the counter it goes to."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _number(value: Any) -> float | None:
    """`value` as a Python float (an int too large for a double becomes +-inf), or None."""
    if getattr(value, "shape", None) == () and hasattr(value, "item"):  # 0-d numpy / torch
        value = value.item()
    if not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:   # e.g. 10**400
        return math.inf if value > 0 else -math.inf


def _float32_problem(x: float, raw: Any = None) -> tuple[str, str] | None:
    """(kind, message) when `x` (read from `raw`) is not a finite float32, else None."""
    if isinstance(raw, numbers.Integral) and not math.isfinite(x):
        return "out_of_range", f"returned an integer of {len(str(abs(int(raw))))} digits, beyond float32's range (+-3.4e38)"
    if not math.isfinite(x):
        return "non_finite", f"returned {x}"
    if abs(x) > FLOAT32_MAX:
        return "out_of_range", f"returned {x:.3g}, beyond float32's range (+-3.4e38)"
    return None


def read_score(value: Any, score_key: str = "score") -> tuple[float, dict[str, float]]:
    """(score, metrics) from a function's return value; raises `BadScore` ("non_finite", "out_of_range",
    "not_a_number", "missing_score_key")."""
    metrics: dict[str, float] = {}
    raw = value
    if isinstance(value, dict):
        if score_key not in value:
            raise BadScore("missing_score_key", f"returned a dict without {score_key!r} (reward.score_key); keys: "
                                                f"{', '.join(map(str, value))}")
        raw = value[score_key]
        for k, v in value.items():
            number = _number(v) if k != score_key else None
            if number is not None and _float32_problem(number, v) is None:
                metrics[str(k)] = number
    score = _number(raw)
    if score is None:
        raise BadScore("not_a_number", f"returned {type(raw).__name__} {str(raw)[:80]!r}, not a number")
    problem = _float32_problem(score, raw)
    if problem is not None:
        raise BadScore(*problem)
    return score, metrics
