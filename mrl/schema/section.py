"""Declaring job-spec sections: typed, frozen dataclasses with checked fields, and reading them back.

Every section of a job spec is a frozen dataclass owned by the component that uses it (the
rollout section lives in `mrl/rollout/config.py`, and so on). Fields are declared with
`option(...)`, which records the range or choices the loader checks and a one-line help text;
the introspection below (`fields_of`, `all_keys`, ...) is what the loader, `mrl keys` and
`mrl convert` walk. This package is the bottom floor: it imports nothing of mrl.
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Callable

_MISSING = dataclasses.MISSING

INT_MIN, INT_MAX = -2**31, 2**31 - 1   # the default range of an integer key
SEED_MAX = 2**32 - 1                    # seeds: what numpy, torch and the engines accept


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


# ---- introspection ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    type: Any
    meta: dict
    required: bool


@functools.cache
def fields_of(cls) -> dict[str, Field]:
    """Name -> Field for a section class, with resolved type hints."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        required = f.default is _MISSING and f.default_factory is _MISSING
        out[f.name] = Field(f.name, hints[f.name], dict(f.metadata), required)
    return out


def is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def optional_inner(tp: Any) -> Any | None:
    """X for Optional[X] (Union[A, B] for Optional[Union[A, B]]), else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        every = typing.get_args(tp)
        args = [a for a in every if a is not type(None)]
        if len(args) < len(every):
            return args[0] if len(args) == 1 else typing.Union[tuple(args)]
    return None


def union_members(tp: Any) -> tuple | None:
    """(A, B, ...) for a union of values without None (e.g. Union[float, str]: a number or a name,
    tried in that order), else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) not in typing.get_args(tp):
        return typing.get_args(tp)
    return None


def section_of(tp: Any):
    """The section class inside `tp` (X or Optional[X]), or None."""
    inner = optional_inner(tp)
    tp = inner if inner is not None else tp
    return tp if is_section(tp) else None


def tables_of(tp: Any):
    """The section class X of a list of tables `tuple[X, ...]` (`[[a.b]]` in TOML), or None."""
    if typing.get_origin(tp) is tuple:
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        if len(args) == 1 and is_section(args[0]):
            return args[0]
    return None


def all_keys(cls, prefix: str = "") -> list[str]:
    """Every dotted key of a section tree, tables included."""
    keys = []
    for name, f in fields_of(cls).items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        sub = section_of(f.type)
        if sub is not None:
            keys.extend(all_keys(sub, dotted + "."))
    return keys
