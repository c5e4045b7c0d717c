"""`mrl convert`: a verl configuration (Hydra YAML, a command line, a launch script read as bash
would run it, or several of these) -> one commented mrl TOML job, starting from the verl 0.9.1 named
config the inputs compose (`main_ppo`'s, Megatron's, or a recipe's such as DAPO's).

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

from mrl.config.verl_table import verl_table
from mrl.convert import rules
from mrl.convert.verl_config import (COMMAND_LINE, DEFAULT, ENGINE_CONFIGS, NAMED_CONFIGS, VerlConfig, apply_override,
                                     named_config, read_script, read_yaml, resolve, start, verl_defaults, verl_version)
from mrl.schema.section import fields_of, optional_inner, section_of


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
    refused: list[str] = field(default_factory=list)                          # capabilities mrl lacks
    notes: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)


def _mrl_defaults() -> dict[str, tuple[Any, Any]]:
    """mrl key -> (default, declared type) for every leaf of the RL job spec."""
    from mrl.config.job import JobSpec

    out = {}

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            info = fields_of(cls)[f.name]
            sub = section_of(info.type)
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
    from mrl.config.paths import PATH_KEYS, _resolve_path

    inner = optional_inner(tp) or tp
    if isinstance(value, str) and getattr(inner, "__origin__", None) is tuple:
        value = [value]
    kind = PATH_KEYS.get(mrl_key)
    if kind is not None:
        expand = (lambda v: _resolve_path(os.path.expanduser(v), kind, base) if isinstance(v, str) else v)
        value = [expand(v) for v in value] if isinstance(value, list) else expand(value)
    return value


def _base_config(yaml_files: list[Path], bases: list[str], tokens: list[str], given: VerlConfig,
                 config_name: str | None) -> str:
    """The verl named config the inputs compose: `--config-name` (or the recipe's entry point), a
    YAML's `defaults:` base or the YAML's own name, `model_engine=`, Megatron's strategy."""
    from mrl.errors import UserError

    name = config_name or (bases[0] if bases else None) or next(
        (p.stem.removeprefix("_generated_") for p in yaml_files if p.stem.removeprefix("_generated_") in NAMED_CONFIGS),
        None) or "ppo_trainer"
    engine = None
    for token in tokens:
        key, _, value = token.lstrip("+").partition("=")
        if key == "model_engine":
            engine = value.strip()
    if engine is not None:
        if engine not in ENGINE_CONFIGS:
            raise UserError(f"{COMMAND_LINE}: model_engine={engine}: not one of verl's engines ({', '.join(ENGINE_CONFIGS)})")
        if name.startswith("ppo_"):
            name = ENGINE_CONFIGS[engine]
        elif engine == "megatron":
            name = named_config(name, True)
    return named_config(name, given.raw.get("actor_rollout_ref.actor.strategy") == "megatron")


def convert(yaml_files: list[Path], overrides: list[str], base: Path | None = None,
            config_name: str | None = None, describe=None) -> Conversion:
    """Convert verl's defaults (of the named config the inputs compose) + `yaml_files` +
    `overrides` (Hydra tokens) into mrl values. `describe` turns a value with unknown-value markers
    (a script's `$(...)`) into readable text."""
    from mrl.config.paths import PATH_KEYS
    from mrl.convert.reward_keys import migrate
    from mrl.convert.shell import MARK

    base = base or Path.cwd()
    describe = describe or (lambda text: text)
    given = VerlConfig()              # the inputs alone: which named config applies
    bases: list[str] = []
    for path in yaml_files:
        bases += read_yaml(path, given)
    engine = [t for t in overrides if t.lstrip("+").partition("=")[0] == "model_engine"]   # Hydra's group choice
    overrides = [t for t in overrides if t not in engine]
    for token in overrides:
        apply_override(token, given, {}, lenient=True)
    name = _base_config(yaml_files, bases, engine, given, config_name)
    defaults = verl_defaults(name=name)
    cfg: VerlConfig = start(defaults)
    out = Conversion(sources=[str(p) for p in yaml_files] + ([COMMAND_LINE] if overrides else []))
    out.notes.append(f"verl {verl_version()}'s {name} defaults" + (f" ({', '.join(engine)})" if engine else ""))
    for path in yaml_files:
        read_yaml(path, cfg)
    for token in overrides:
        apply_override(token, cfg, defaults)
    out.notes += cfg.notes
    resolved, unresolved = resolve(cfg)
    aliases, notes = migrate(cfg, resolved, defaults)
    out.notes += notes
    table = verl_table()
    mrl = _mrl_defaults()
    candidates: dict[str, list[Candidate]] = {}
    for key in sorted(cfg.raw):
        shown = aliases.get(key, key)       # the name the user wrote (a legacy reward key moved to reward.*)
        value, is_default = resolved[key], cfg.is_default(key, defaults)
        entry = table.mapping(key)
        if key in unresolved and not is_default:
            out.not_converted.append((shown, cfg.raw[key], f"unresolved interpolation: {unresolved[key]}"))
            continue
        if isinstance(value, str) and MARK in value:
            what = describe(value)
            if entry is None and table.reason(key):
                out.not_converted.append((shown, what, table.reason(key)))
            elif entry is not None and entry.placeholder:
                out.not_converted.append((shown, what, "computed by the script when it runs; mrl names the run "
                                                       f"itself (set {entry.target} to choose)"))
            else:
                out.problems.append(f"{shown} = {what!r}: mrl convert cannot compute this value (the script computes "
                                    f"it when it runs); supply {entry.target if entry else 'its value'}")
            continue
        if isinstance(value, str) and "$" in value.replace("${", "") and cfg.origin.get(key) != DEFAULT:
            out.problems.append(f"{shown} = {value!r}: a shell variable that mrl convert could not expand; "
                                f"supply {entry.target if entry else 'its value'}")
            continue
        if value == "???":   # Hydra's "mandatory" marker, never set: mrl's default applies
            out.dropped.append((shown, value, "mandatory in verl but not set; mrl's default applies"))
            continue
        if entry is None:
            reason = table.reason(key) or "not in mrl's verl key table: no known counterpart"
            (out.dropped if is_default else out.not_converted).append((shown, value, reason))
            continue
        t = rules.translate(entry, key, resolved, table.condition(key))
        problem = t.problem.replace(key, shown) if t.problem and shown != key else t.problem   # the user's name
        if problem and problem not in out.problems:   # a rule read by two keys reports once
            out.problems.append(problem)
        if t.refused:
            out.refused.append(t.refused)
            continue
        if t.no_counterpart:
            (out.dropped if is_default else out.not_converted).append((shown, value, t.no_counterpart))
            continue
        if not t.values:
            if t.problem is None:
                (out.dropped if is_default else out.not_read).append((shown, value, t.skipped or ""))
            continue
        for mrl_key, new in t.values.items():
            new = _as_mrl(new, mrl[mrl_key][1], mrl_key, base)
            cands = candidates.setdefault(mrl_key, [])
            cand = Candidate(shown, new, t.note, is_default, entry.placeholder)
            # a switch that selects a mode (verl's distillation.enabled -> algorithm.advantage = "distill")
            # overrides the plain value it sits beside, whatever the key order
            cands.insert(0, cand) if entry.rule == "switches_to" else cands.append(cand)
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


@dataclass
class Inputs:
    yamls: list[Path]
    tokens: list[str]
    config_name: str | None = None
    describe: Any = None
    notes: list[str] = field(default_factory=list)


def inputs(items: list[str]) -> Inputs:
    """The YAML files and Hydra override tokens among `mrl convert`'s arguments (a shell script
    contributes its trainer command: overrides, named config, its own config YAML)."""
    from mrl.convert.verl_config import command_line_overrides
    from mrl.errors import UserError

    found = Inputs([], [])
    scripts = 0
    items = list(items)
    while items:
        item = items.pop(0)
        flag, eq, value = item.partition("=")
        if flag in ("--config-name", "-cn"):      # a pasted verl command line
            found.config_name = (value if eq else (items.pop(0) if items else "")).removesuffix(".yaml")
            if found.config_name not in NAMED_CONFIGS:
                raise UserError(f"--config-name {found.config_name}: not one of verl's named configs "
                                f"({', '.join(NAMED_CONFIGS)}); give the YAML itself to mrl convert")
            continue
        if flag in ("--config-path", "-cp", "--config-dir", "-cd"):
            if not eq and items:
                items.pop(0)
            found.notes.append(f"{item}: verl's named configs are mrl's copies; a YAML of your own: give it to mrl convert")
            continue
        if item.endswith((".yaml", ".yml")) and "=" not in item:
            found.yamls.append(Path(item))
        elif item.endswith(".sh") and "=" not in item:
            script = read_script(Path(item))
            scripts += 1
            if scripts > 1:
                raise UserError(f"{item}: mrl convert reads one script at a time")
            found.yamls += script.yamls
            found.tokens += script.tokens
            found.config_name, found.describe = script.config_name, script.describe
            found.notes += script.notes
        else:
            found.tokens.append(item)
    found.tokens = command_line_overrides(found.tokens)
    if not found.yamls and not found.tokens and not scripts:
        raise UserError("mrl convert: give a verl YAML, a script running verl.trainer.main_ppo (or a recipe's "
                        "trainer), or key=value overrides")
    return found


__all__ = ["Conversion", "convert", "render", "inputs", "DEFAULT"]
