"""Building blocks for job-spec sections: typed, frozen dataclasses with checked fields.

Every section of a job spec is a frozen dataclass owned by the component that uses it (the
rollout section lives in `mrl/rollout/config.py`, and so on). Fields are declared with
`option(...)`, which records the range or choices the loader checks and a one-line help text.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
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


def describe(tp: Any) -> str:
    """Human name of a type, for error messages."""
    inner = optional_inner(tp)
    if inner is not None:
        return f"{describe(inner)} or none"
    members = union_members(tp)
    if members is not None:
        return " or ".join(describe(m) for m in members)
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"a list of {describe(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a table"
    if is_section(tp):
        return "a table"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def kind_of(value: Any) -> str:
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, int):
        return f"an integer ({value})"
    if isinstance(value, float):
        return f"a number ({value})"
    if isinstance(value, str):
        return f"a string ({value!r})"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, (list, tuple)):
        return "a list"
    if value is None:
        return "none"
    return type(value).__name__


INT_MIN, INT_MAX = -2**31, 2**31 - 1   # the default range of an integer key
SEED_MAX = 2**32 - 1                    # seeds: what numpy, torch and the engines accept


class ValueProblem(Exception):
    """A value does not fit its field; the message completes '<key>: ...'."""


def convert(value: Any, tp: Any) -> Any:
    """Check `value` (as parsed from TOML) against type `tp`; return it in canonical form."""
    inner = optional_inner(tp)
    if inner is not None:
        return None if value is None else convert(value, inner)
    if value is None:
        raise ValueProblem(f"must be {describe(tp)}, not none")
    members = union_members(tp)
    if members is not None:   # the first member the value fits
        for member in members:
            try:
                return convert(value, member)
            except ValueProblem:
                continue
        raise ValueProblem(f"must be {describe(tp)}, got {kind_of(value)}")
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if value in choices and type(value) in {type(c) for c in choices}:
            return value
        hint = ""
        if isinstance(value, str):
            close = difflib.get_close_matches(value, [c for c in choices if isinstance(c, str)], n=1, cutoff=0.5)
            if close:
                hint = f"; did you mean {close[0]!r}?"
        raise ValueProblem(f"{value!r} is not {describe(tp)}{hint}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueProblem(f"must be {describe(tp)}, got {kind_of(value)}")
        (elem,) = [a for a in typing.get_args(tp) if a is not Ellipsis]
        out = []
        for i, v in enumerate(value):
            try:
                out.append(convert(v, elem))
            except ValueProblem as e:
                raise ValueProblem(f"element {i}: {e}") from None
        return tuple(out)
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueProblem(f"must be a table, got {kind_of(value)}")
        key_t, val_t = typing.get_args(tp)
        return {k: (v if val_t is Any else convert(v, val_t)) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                out = float(value)
            except OverflowError:
                raise ValueProblem(f"must be a finite number, got {value}") from None
            if not math.isfinite(out):
                raise ValueProblem(f"must be a finite number, got {out}")
            return out
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is Any:
        return value
    raise ValueProblem(f"must be {describe(tp)}, got {kind_of(value)}")


def check_range(value: Any, meta: dict) -> None:
    """Apply option(ge=, gt=, le=, lt=, choices=) to a converted value (elementwise for tuples)."""
    if value is None:
        return
    if isinstance(value, tuple):
        for i, v in enumerate(value):
            try:
                check_range(v, meta)
            except ValueProblem as e:
                raise ValueProblem(f"element {i}: {e}") from None
        return
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ValueProblem(f"{value!r} is not one of {', '.join(map(repr, choices))}")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    if isinstance(value, int):   # counts, sizes, steps and seeds: bounded to 32 bits unless the field says
        meta = {"ge": INT_MIN, "le": INT_MAX, **{k: v for k, v in meta.items() if v is not None}}
    for bound, ok, word in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                            ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<")):
        b = meta.get(bound)
        if b is not None and not ok(value, b):
            raise ValueProblem(f"must be {word} {b}, got {value}")
