"""Render a resolved spec as TOML that loads back to the same spec (`mrl show`)."""
from __future__ import annotations

import dataclasses

import tomli_w


def _plain(value):
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if getattr(value, f.name) is not None}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    return value


def to_dict(spec) -> dict:
    """Nested plain dict of a spec; `None` (unset optional) fields are left out, as TOML has no null."""
    return _plain(spec)


def to_toml(spec) -> str:
    return tomli_w.dumps(to_dict(spec))
