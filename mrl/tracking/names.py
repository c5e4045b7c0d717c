"""Names MLflow accepts: metric, param and tag keys are sanitised before they are written.

MLflow rejects a whole batch when one key holds a character outside letters, digits, `_ - . / `
and space (or one that normalises as a path to another name: `a//b`, `./a`, `a/`), so a reward
metric named `pass@1` would otherwise fail every step's write. `legal_name` maps such a key to
one MLflow accepts (`pass@1` -> `pass_at_1`); `NameMap` applies it and says each new mapping
once, so a user finds the renamed metric in the UI.
"""
from __future__ import annotations

import logging
import posixpath
import re
from typing import Callable, Mapping, TypeVar

log = logging.getLogger(__name__)

_LEGAL = re.compile(r"^[A-Za-z0-9_\-./ ]+$")
_ILLEGAL_CHAR = re.compile(r"[^A-Za-z0-9_\-./ ]")
_WORDS = {"@": "_at_", "%": "_pct", "#": "_n", "+": "_plus_", "=": "_eq_", "<": "_lt_", ">": "_gt_"}
MAX_KEY_CHARS = 250   # MLflow's key limit

V = TypeVar("V")


def is_legal_name(name: str) -> bool:
    """Whether MLflow accepts `name` as a metric, param or tag key unchanged."""
    return (bool(_LEGAL.match(name)) and posixpath.normpath(name) == name and not name.startswith(("/", ".."))
            and name != "." and len(name) <= MAX_KEY_CHARS)


def legal_name(name: str) -> str:
    """`name` itself when MLflow accepts it, else a readable legal name: `@ % # + = < >` become
    words (`pass@1` -> `pass_at_1`), other characters `_`, and path-like parts (`//`, `.`, `..`,
    leading or trailing `/`) are flattened."""
    if is_legal_name(name):
        return name
    out = "".join(_WORDS.get(c, c) for c in str(name))
    out = _ILLEGAL_CHAR.sub("_", out)
    parts = [p if p not in (".", "..") else "_" * len(p) for p in out.split("/") if p]
    out = "/".join(parts) or "_"
    return out[:MAX_KEY_CHARS]


class NameMap:
    """Sanitises keys with `legal_name`; each key that changes is said once (a warning naming the
    new key), and two keys that would collide keep apart (a numeric suffix)."""

    def __init__(self, say: Callable[[str], None] | None = None):
        self._say = say or log.warning
        self._mapped: dict[str, str] = {}
        self._taken: set[str] = set()

    def name(self, key: str) -> str:
        key = str(key)
        if key in self._mapped:
            return self._mapped[key]
        new = legal_name(key)
        if new != key:
            base, n = new, 1
            while new in self._taken:
                n += 1
                new = f"{base}_{n}"
            self._say(f"tracking: the key {key!r} is not a legal MLflow name; it is logged as {new!r}")
        self._mapped[key] = new
        self._taken.add(new)
        return new

    def keys(self, items: Mapping[str, V]) -> dict[str, V]:
        """`items` with every key sanitised."""
        return {self.name(k): v for k, v in items.items()}


def numbers(metrics: Mapping[str, object]) -> dict[str, float]:
    """The values of `metrics` that are numbers, as floats; the rest (strings, tables) are left
    out. Every backend (MLflow journal, Prometheus, wandb) logs exactly these."""
    out = {}
    for k, v in metrics.items():
        try:
            out[k] = float(v)
        except (TypeError, ValueError):
            continue
    return out
