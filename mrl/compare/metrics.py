"""Metric groups `mrl compare` knows by name, which way is better, and final / best values.

Best is the maximum for rewards and accuracy, the minimum for losses, KL and train/rollout
mismatch; other metrics (entropy, length, time) have no best, only a final value.
"""
from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass
from typing import Iterable, Literal, Optional, Sequence

from mrl.compare.data import Point, finite
from mrl.errors import UserError

GROUPS: dict[str, tuple[str, ...]] = {
    "reward": ("reward/mean",),
    "kl": ("kl/*", "actor/kl_loss", "actor/pg_approx_kl"),
    "entropy": ("actor/entropy",),
    "length": ("response/length_mean",),
    "mismatch": ("rollout/logprob_abs_diff_mean", "rollout/kl_k3"),
    "time": ("time/step",),
}
DEFAULT_GROUPS = tuple(GROUPS)

# First match wins. "Lower is better" is checked first so that e.g. reward/errors is not maximised.
_MIN = re.compile(r"loss|(^|[/_])kl([/_]|$)|abs_diff|mismatch|error|dropped")
_MAX = re.compile(r"reward|acc|score|pass@|pass_at")

Mode = Literal["max", "min"]


def best_mode(key: str) -> Optional[Mode]:
    """"min" for losses / KL / mismatch, "max" for rewards / accuracy, None when neither applies."""
    k = key.lower()
    if _MIN.search(k):
        return "min"
    if _MAX.search(k):
        return "max"
    return None


@dataclass(frozen=True)
class Choice:
    """A `--metrics` item: the patterns it stands for and whether the user named a key outright."""

    item: str
    patterns: tuple[str, ...]
    explicit: bool


def parse_choice(spec: Optional[str]) -> list[Choice]:
    """`reward,kl,actor/grad_norm,reward/score/*` -> choices; None or "" means every group."""
    items = [s.strip() for s in (spec or "").split(",") if s.strip()] or list(DEFAULT_GROUPS)
    choices = []
    for item in items:
        if item in GROUPS:
            choices.append(Choice(item, GROUPS[item], explicit=False))
        elif "/" in item or "*" in item or "?" in item:
            choices.append(Choice(item, (item,), explicit=True))
        else:
            raise UserError(f"--metrics {item}: not a metric group ({', '.join(GROUPS)}) "
                            f"or a metric key such as reward/mean or kl/*")
    return choices


def expand(choices: Sequence[Choice], logged: Iterable[str]) -> tuple[list[str], list[str]]:
    """Metric keys the choices select among those the runs `logged` (in choice order, each once), and
    the group patterns that matched nothing. A key or pattern the user named outright must match."""
    logged = sorted(set(logged))
    keys: list[str] = []
    missing: list[str] = []
    for choice in choices:
        for pattern in choice.patterns:
            hits = [k for k in logged if fnmatch.fnmatchcase(k, pattern)]
            if not hits:
                if choice.explicit:
                    close = [k for k in logged if k.split("/")[0] == pattern.split("/")[0]][:8]
                    raise UserError(f"--metrics {pattern}: no run logged it"
                                    + (f" (they log {', '.join(close)}, ...)" if close else ""))
                missing.append(pattern)
            keys.extend(k for k in hits if k not in keys)
    return keys, missing


@dataclass(frozen=True)
class Summary:
    """A run's metric: value at its last step, and its best value and step where a direction applies."""

    final: Optional[Point]
    best: Optional[Point]
    mode: Optional[Mode]


def summarize(key: str, points: Sequence[Point]) -> Summary:
    mode = best_mode(key)
    final = points[-1] if points else None
    values = finite(points)
    best = None
    if mode is not None and values:
        pick = max if mode == "max" else min
        best = pick(values, key=lambda p: p.value)  # the earliest step among ties
    return Summary(final, best, mode)


def fmt(point: Optional[Point]) -> str:
    if point is None:
        return "-"
    v = point.value
    text = "nan" if math.isnan(v) else f"{v:.4g}"
    return f"{text} @{point.step}"
