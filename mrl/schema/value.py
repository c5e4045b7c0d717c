"""Checking one value against its field: the type (`convert`), the range or choices
(`check_range`), and the words errors use for types and values (`describe`, `kind_of`).

A problem is a `ValueProblem` whose message completes "<key>: ..."; the loader adds the key.
"""
from __future__ import annotations

import difflib
import math
import typing
from typing import Any

from mrl.schema.section import INT_MAX, INT_MIN, is_section, optional_inner, union_members


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
