"""`mrl convert`: a verl `main_ppo` configuration (Hydra YAML, command line, or both) -> one
commented mrl TOML job.

Every verl key ends up in one of four places: an mrl key (its value translated by the rule of its
entry in `mrl/config/verl_keys.toml`), a comment saying why it has no counterpart, a comment
saying why verl would not read it here (e.g. critic settings of a GRPO job), or the count of
dropped keys: those equal to verl's default that have no counterpart or map to mrl's default
(a YAML that verl dumped holds every default). `--all` lists the dropped keys too.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mrl.config import schema
from mrl.config.verl_table import verl_table
from mrl.convert import rules
from mrl.convert.verl_config import (COMMAND_LINE, DEFAULT, VerlConfig, apply_override, read_script, read_yaml,
                                     resolve, start, verl_defaults)


@dataclass
class Candidate:
    verl: str
    value: Any
    note: str
    from_default: bool
    placeholder: bool = False


@dataclass
class Conversion:
    """What `mrl convert` found: mrl values with the verl keys behind them, and every verl key it did not map."""
    values: dict[str, Candidate] = field(default_factory=dict)
    not_converted: list[tuple[str, Any, str]] = field(default_factory=list)   # (verl key, value, reason)
    not_read: list[tuple[str, Any, str]] = field(default_factory=list)        # verl would not read them here
    dropped: list[tuple[str, Any, str]] = field(default_factory=list)         # defaults with nothing to say
    problems: list[str] = field(default_factory=list)                         # values the user must choose
    notes: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)


def _mrl_defaults() -> dict[str, tuple[Any, Any]]:
    """mrl key -> (default, declared type) for every leaf of the RL job spec."""
    from mrl.config.job import JobSpec

    out = {}

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            info = schema.fields_of(cls)[f.name]
            sub = schema.section_of(info.type)
            if sub is not None:
                walk(sub, prefix + f.name + ".")
                continue
            default = None if info.required else (f.default_factory() if f.default_factory is not dataclasses.MISSING
                                                  else f.default)
            out[prefix + f.name] = (list(default) if isinstance(default, tuple) else default, info.type)
    walk(JobSpec, "")
    return out


def _as_mrl(value: Any, tp: Any, mrl_key: str, base: Path) -> Any:
    """A verl value in the shape mrl declares: a single path becomes a list where mrl takes a list;
    paths are made absolute (verl reads them from its working directory, mrl from the job file)."""
    from mrl.config.loader import PATH_KEYS, _resolve_path

    inner = schema.optional_inner(tp) or tp
    if isinstance(value, str) and getattr(inner, "__origin__", None) is tuple:
        value = [value]
    kind = PATH_KEYS.get(mrl_key)
    if kind is not None:
        expand = (lambda v: _resolve_path(os.path.expanduser(v), kind, base) if isinstance(v, str) else v)
        value = [expand(v) for v in value] if isinstance(value, list) else expand(value)
    return value


def convert(yaml_files: list[Path], overrides: list[str], base: Path | None = None) -> Conversion:
    """Convert verl's defaults + `yaml_files` + `overrides` (Hydra tokens) into mrl values."""
    from mrl.config.loader import PATH_KEYS

    base = base or Path.cwd()
    given = VerlConfig()              # the inputs alone: which backend's defaults apply
    for path in yaml_files:
        read_yaml(path, given)
    for token in overrides:
        apply_override(token, given, {}, lenient=True)
    defaults = verl_defaults(given.raw.get("actor_rollout_ref.actor.strategy") == "megatron")
    cfg: VerlConfig = start(defaults)
    out = Conversion(sources=[str(p) for p in yaml_files] + ([COMMAND_LINE] if overrides else []))
    for path in yaml_files:
        read_yaml(path, cfg)
    for token in overrides:
        apply_override(token, cfg, defaults)
    out.notes += cfg.notes
    resolved, unresolved = resolve(cfg)
    table = verl_table()
    mrl = _mrl_defaults()
    candidates: dict[str, list[Candidate]] = {}
    for key in sorted(cfg.raw):
        value, is_default = resolved[key], cfg.is_default(key, defaults)
        if key in unresolved and not is_default:
            out.not_converted.append((key, cfg.raw[key], f"unresolved interpolation: {unresolved[key]}"))
            continue
        if isinstance(value, str) and "$" in value.replace("${", "") and cfg.origin.get(key) != DEFAULT:
            out.problems.append(f"{key} = {value!r}: a shell variable that mrl convert could not expand; "
                                f"supply {table.mapped[key].target if key in table.mapped else 'its value'}")
            continue
        if value == "???":   # Hydra's "mandatory" marker, never set: mrl's default applies
            out.dropped.append((key, value, "mandatory in verl but not set; mrl's default applies"))
            continue
        entry = table.mapped.get(key)
        if entry is None:
            reason = table.reason(key) or "not in mrl's verl key table: no known counterpart"
            (out.dropped if is_default else out.not_converted).append((key, value, reason))
            continue
        t = rules.translate(entry, key, resolved, table.condition(key))
        if t.problem and t.problem not in out.problems:   # a rule read by two keys reports once
            out.problems.append(t.problem)
        if not t.values:
            if t.problem is None:
                (out.dropped if is_default else out.not_read).append((key, value, t.skipped or ""))
            continue
        for mrl_key, new in t.values.items():
            new = _as_mrl(new, mrl[mrl_key][1], mrl_key, base)
            candidates.setdefault(mrl_key, []).append(Candidate(key, new, t.note, is_default, entry.placeholder))
    for mrl_key, cands in candidates.items():
        chosen = [c for c in cands if not c.from_default] or cands
        first = chosen[0]
        for other in chosen[1:]:
            if other.value != first.value and not other.from_default:
                out.notes.append(f"{other.verl} = {other.value!r} conflicts with {first.verl} for {mrl_key}; "
                                 f"{first.verl} was used")
        if all(c.from_default for c in cands):
            mrl_default = mrl[mrl_key][0]
            if first.value == mrl_default or PATH_KEYS.get(mrl_key) or first.placeholder:   # nothing to say, or an example
                out.dropped += [(c.verl, c.value, f"verl's default, = {mrl_key} default" if first.value == mrl_default
                                 else "verl's placeholder path") for c in cands]
                continue
        out.values[mrl_key] = first
    return out


# ---- TOML output --------------------------------------------------------------------------------

def _toml_value(value: Any) -> str:
    """One TOML value on one line (lists inline)."""
    import tomli_w

    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return tomli_w.dumps({"v": value}).strip()[len("v = "):]


def render(conv: Conversion, list_dropped: bool = False) -> str:
    """The commented TOML job."""
    lines = [f"# Converted by `mrl convert` from verl ({', '.join(conv.sources) or 'verl defaults'}).",
             "# Each key says which verl key it came from; the verl keys with no mrl counterpart are listed at the end.",
             f"# {len(conv.dropped)} verl keys were dropped: equal to verl's default, with no counterpart or mapping "
             "to mrl's default" + ("" if list_dropped else " (`mrl convert --all` lists them)") + "."]
    sections: dict[str, list[str]] = {}
    for mrl_key in sorted(conv.values):
        c = conv.values[mrl_key]
        section, _, leaf = mrl_key.rpartition(".")
        comment = f"verl {c.verl}" + (f": {c.note}" if c.note else "") + (" (verl's default)" if c.from_default else "")
        sections.setdefault(section, []).append(f"{leaf} = {_toml_value(c.value)}   # {comment}")
    for section in sorted(sections, key=_section_order):
        lines += ["", f"[{section}]", *sections[section]]

    def block(title, items):
        if items:
            lines.extend(["", f"# ---- {title} ----"])
            lines.extend(f"# {k} = {_short(v)}: {why}" for k, v, why in items)
    block("verl keys with no mrl counterpart", conv.not_converted)
    block("verl keys verl would not read in this configuration", conv.not_read)
    if list_dropped:
        block("dropped: verl's defaults", conv.dropped)
    for note in conv.notes:
        lines.append(f"# note: {note}")
    return "\n".join(lines) + "\n"


_ORDER = ["job", "platform", "parallel", "model", "data", "rollout", "algorithm", "actor", "critic", "ref", "reward",
          "trainer", "checkpoint", "tracking"]


def _section_order(section: str) -> tuple[int, str]:
    top = section.split(".", 1)[0]
    return (_ORDER.index(top) if top in _ORDER else len(_ORDER), section)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def inputs(items: list[str]) -> tuple[list[Path], list[str]]:
    """The YAML files and Hydra override tokens among `mrl convert`'s arguments (a shell script
    contributes the overrides of its `main_ppo` command)."""
    from mrl.convert.verl_config import command_line_overrides
    from mrl.errors import UserError

    yamls: list[Path] = []
    tokens: list[str] = []
    for item in items:
        if item.endswith((".yaml", ".yml")) and "=" not in item:
            yamls.append(Path(item))
        elif item.endswith(".sh") and "=" not in item:
            tokens += read_script(Path(item))
        else:
            tokens.append(item)
    tokens = command_line_overrides(tokens)
    if not yamls and not tokens:
        raise UserError("mrl convert: give a verl YAML, a script running verl.trainer.main_ppo, or key=value overrides")
    return yamls, tokens


__all__ = ["Conversion", "convert", "render", "inputs", "DEFAULT"]
