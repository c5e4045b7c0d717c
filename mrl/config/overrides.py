"""Command-line overrides (`key=value` after the job file): typed by the field they set, so
`actor.optim.lr=1e-6` is a number and `data.train_files=[a, b]` a list, then merged into the raw table."""
from __future__ import annotations

import re
import tomllib
import typing
from typing import Any

from mrl.config.report import COMMAND_LINE, Origin, Report
from mrl.config.suggest import explain_unknown
from mrl.schema.section import all_keys, fields_of, optional_inner, section_of, union_members


def _field_at(cls, dotted: str):
    """(Field, is_inside_free_table) for a dotted key, or None if the key does not exist."""
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        f = fields_of(cls).get(part)
        if f is None:
            return None
        if i == len(parts) - 1:
            return f, False
        sub = section_of(f.type)
        if sub is None:
            return (f, True) if typing.get_origin(f.type) is dict else None
        cls = sub
    return None


_PLAIN_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _parse_override_value(text: str, tp: Any) -> Any:
    """Coerce a command-line string to the schema type `tp` (best effort; convert() checks)."""
    inner = optional_inner(tp)
    if inner is not None:
        if text.strip().lower() in ("none", "null"):
            return None
        tp = inner
    stripped = text.strip()
    members = union_members(tp)
    if members is not None and str in members:
        # a number or a name (e.g. a rejection threshold: 0.01 or "0.5_2.0"): only a plain decimal
        # is a number, since TOML would read 0.5_2 as 0.52
        if float in members and _PLAIN_NUMBER.fullmatch(stripped):
            return float(stripped)
        return _parse_override_value(text, str)
    is_tuple = typing.get_origin(tp) is tuple
    literal_strs = typing.get_origin(tp) is typing.Literal and all(isinstance(a, str) for a in typing.get_args(tp))
    if tp is str or literal_strs:
        if len(stripped) >= 2 and stripped[0] == stripped[-1] and stripped[0] in "\"'":
            return stripped[1:-1]
        return text
    try:
        value = tomllib.loads(f"v = {stripped}")["v"]
    except tomllib.TOMLDecodeError:
        value = None
    if tp is bool and not isinstance(value, bool):
        value = {"true": True, "yes": True, "on": True, "1": True,
                 "false": False, "no": False, "off": False, "0": False}.get(stripped.lower(), text)
    elif value is None:
        if is_tuple:   # [a, b] or a,b,c with bare (unquoted) elements, or a single bare element
            elem = typing.get_args(tp)[0]
            if len(stripped) >= 2 and stripped[0] == "[" and stripped[-1] == "]":
                stripped = stripped[1:-1]
                if not stripped.strip():
                    return []
            return [_parse_override_value(p.strip(), elem) for p in _split_top_level(stripped)]
        return text
    if is_tuple and not isinstance(value, list):
        value = [value]
    return value


def _split_top_level(text: str) -> list[str]:
    """`text` split at the commas outside quotes and brackets (`a, "b,c", [d, e]` -> 3 parts)."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def apply_overrides(raw: dict, overrides: list[str], root, report: Report) -> None:
    """Apply `a.b.c=value` strings to `raw`, typed from the schema; bad ones are reported."""
    valid = all_keys(root)
    for item in overrides:
        key, eq, text = item.partition("=")
        key = key.strip()
        origin = Origin(COMMAND_LINE)
        if not eq or not key:
            report.problems.append(f"{COMMAND_LINE}: {item!r}: an override is dotted.key=value (e.g. actor.optim.lr=2e-6)")
            continue
        found = _field_at(root, key)
        if found is None:
            parent, _, _ = key.rpartition(".")
            siblings = [k.rsplit(".", 1)[-1] for k in valid if k.rpartition(".")[0] == parent]
            report.error(key, explain_unknown(key, siblings, valid), origin)
            continue
        f, free = found
        if not free and section_of(f.type) is not None:
            report.error(key, "is a table; override its keys one by one (e.g. " f"{key}.<key>=value)", origin)
            continue
        value = _parse_free(text) if free else _parse_override_value(text, f.type)
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            nxt = node.get(part)
            if not isinstance(nxt, dict):
                nxt = {}
                node[part] = nxt
            node = nxt
        node[parts[-1]] = value
        report.origins[key] = origin


def _parse_free(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        return text
