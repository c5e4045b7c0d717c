"""Building blocks for job-spec sections: typed, frozen dataclasses with checked fields.

Every section of a job spec is a frozen dataclass owned by the component that uses it (the
rollout section lives in `mrl/rollout/config.py`, and so on). Fields are declared with
`option(...)`, which records the range or choices the loader checks and a one-line help text.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

_MISSING = dataclasses.MISSING


def option(
    default: Any = _MISSING,
    *,
    factory: Callable[[], Any] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: tuple | None = None,
    help: str = "",
) -> Any:
    """A section field with an optional numeric range (ge/gt/le/lt) or a set of choices.

    Leave out both `default` and `factory` for a required field. A range applies to numbers and
    to each element of a tuple of numbers; `None` (for Optional fields) always passes.
    """
    meta = {"ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices, "help": help}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(cls):
    """Decorator: a frozen, keyword-only dataclass usable as a job-spec section."""
    return dataclasses.dataclass(frozen=True, kw_only=True)(cls)
