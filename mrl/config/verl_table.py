"""The verl key table (`verl_keys.toml`, data) as typed entries.

One table serves three readers: the "did you mean" suggestions for verl names in a job
(`suggest.py`), `mrl convert` (which also translates values with the rules an entry names) and
`mrl keys --verl`. Adding a verl key is a line in `verl_keys.toml`; nothing else changes unless it
needs a new value rule (`mrl/convert/rules.py`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

TABLE_FILE = Path(__file__).with_name("verl_keys.toml")
_ENTRY_FIELDS = {"to", "values", "none", "unset", "rule", "placeholder"}


@dataclass(frozen=True)
class Mapping:
    """One verl key that has an mrl counterpart.

    `targets` are the mrl keys it fills (one, or several for a rule such as `pair`); `values` maps
    verl value names to mrl's (str(verl value) -> mrl value); `none` is what verl's null means in
    mrl (None: leave mrl's default); `unset` lists verl values meaning "not set"; `rule` names a
    value translation in `mrl/convert/rules.py` and `params` holds its own parameters;
    `placeholder` marks a verl default that is only an example (a project name).
    """
    verl: str
    targets: tuple[str, ...]
    values: dict[str, Any] = field(default_factory=dict)
    none: Any = None
    unset: tuple[Any, ...] = ()
    rule: str = "copy"
    params: dict[str, str] = field(default_factory=dict)
    placeholder: bool = False      # verl's default is an example value: dropped unless the user set it

    @property
    def target(self) -> str:
        return self.targets[0]


@dataclass(frozen=True)
class VerlTable:
    mapped: dict[str, Mapping]
    not_applicable: dict[str, str]                 # exact verl key -> why mrl has none
    prefixes: dict[str, str]                       # every key under a prefix -> why
    segments: dict[str, str]                       # every key with this dotted part -> why
    read_only_when: dict[str, str] = field(default_factory=dict)   # key prefix -> verl key that must be set

    def mapping(self, key: str) -> Mapping | None:
        """The entry of `key`: its own, or that of a table entry (`rule = "kwargs"`) whose prefix it is under."""
        entry = self.mapped.get(key)
        if entry is not None:
            return entry
        parent = key
        while "." in parent:
            parent = parent.rsplit(".", 1)[0]
            entry = self.mapped.get(parent)
            if entry is not None and entry.rule == "kwargs":
                return entry
        return None

    def condition(self, key: str) -> str | None:
        """The verl key that must be true (non-zero) for verl to read `key`, or "key=a|b" when it
        must have one of these values; None when verl always reads `key`."""
        best = max((p for p in self.read_only_when if key.startswith(p)), key=len, default=None)
        return None if best is None else self.read_only_when[best]

    def reason(self, key: str) -> str | None:
        """Why verl's `key` has no mrl counterpart, or None (mapped, or not in the table)."""
        if key in self.mapped:   # an exact entry wins over its prefix's reason
            return None
        if key in self.not_applicable:
            return self.not_applicable[key]
        best = max((p for p in self.prefixes if key.startswith(p)), key=len, default=None)
        if best is not None:
            return self.prefixes[best]
        for part in key.split("."):
            if part in self.segments:
                return self.segments[part]
        return None

    def rows(self, prefix: str = "") -> list[tuple[str, str, str]]:
        """(verl key, mrl key or "-", rule or reason) for `mrl keys --verl` and the docs."""
        out = [(k, ", ".join(m.targets), _describe(m)) for k, m in self.mapped.items() if k.startswith(prefix)]
        out += [(k, "-", r) for k, r in self.not_applicable.items() if k.startswith(prefix)]
        out += [(k + "*", "-", r) for k, r in self.prefixes.items() if k.startswith(prefix)]
        if not prefix:
            out += [(f"*.{k}.*", "-", r) for k, r in self.segments.items()]
        return sorted(out)


def _describe(m: Mapping) -> str:
    parts = []
    if m.rule != "copy":
        parts.append(m.rule + (f" ({', '.join(f'{k}={v}' for k, v in m.params.items())})" if m.params else ""))
    if m.values:
        parts.append("values " + ", ".join(f"{k} -> {v}" for k, v in m.values.items()))
    if m.none is not None:
        parts.append(f"null -> {m.none}")
    if m.unset:
        parts.append("unset: " + ", ".join(map(str, m.unset)))
    return "; ".join(parts)


def parse_table(raw: dict) -> VerlTable:
    """The typed table from the TOML's dict; raises ValueError on a malformed entry (a bug in the data file)."""
    reasons = raw.get("reasons", {})

    def reason(text: str) -> str:
        if text.startswith("@"):
            if text[1:] not in reasons:
                raise ValueError(f"verl_keys.toml: reason {text!r} is not in [reasons]")
            return reasons[text[1:]]
        return text

    mapped = {}
    for verl, entry in raw.get("mapped", {}).items():
        if isinstance(entry, str):
            mapped[verl] = Mapping(verl, (entry,))
            continue
        to = entry.get("to")
        if to is None:
            raise ValueError(f"verl_keys.toml: [mapped] {verl} has no `to`")
        params = {k: v for k, v in entry.items() if k not in _ENTRY_FIELDS}
        mapped[verl] = Mapping(verl, tuple(to) if isinstance(to, list) else (to,),
                               values={str(k): v for k, v in entry.get("values", {}).items()},
                               none=entry.get("none"), unset=tuple(entry.get("unset", ())),
                               rule=entry.get("rule", "copy"), params=params,
                               placeholder=bool(entry.get("placeholder", False)))
    na = {k: reason(v) for k, v in raw.get("not_applicable", {}).items()}
    both = set(na) & set(mapped)
    if both:
        raise ValueError(f"verl_keys.toml: both mapped and not applicable: {sorted(both)}")
    return VerlTable(mapped=mapped, not_applicable=na,
                     prefixes={k: reason(v) for k, v in raw.get("not_applicable_prefixes", {}).items()},
                     segments={k: reason(v) for k, v in raw.get("not_applicable_segments", {}).items()},
                     read_only_when=dict(raw.get("read_only_when", {})))


@functools.cache
def verl_table() -> VerlTable:
    return parse_table(tomllib.loads(TABLE_FILE.read_text(encoding="utf-8")))


@functools.cache
def reasons() -> dict[str, str]:
    """The shared reasons of the data file ([reasons]), by name."""
    return dict(tomllib.loads(TABLE_FILE.read_text(encoding="utf-8")).get("reasons", {}))
