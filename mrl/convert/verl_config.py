"""A verl `main_ppo` configuration as one flat dict: verl's defaults, then YAML files, then
command-line overrides, with Hydra interpolations resolved.

verl composes its config with Hydra: a YAML (often one verl dumped, holding every default) and
`key=value` / `+key=value` / `++key=value` / `~key` overrides. This module reproduces the parts of
that a converter needs, on flat dotted keys, and records where each value came from.
"""
from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mrl.convert.safe_read import load_yaml, read_text
from mrl.errors import UserError

DEFAULTS_FILE = Path(__file__).resolve().parents[1] / "config" / "verl_defaults.json"
DEFAULT = "verl default"
COMMAND_LINE = "command line"
_MISSING = object()
MAX_INTERPOLATION_DEPTH = 50          # ${a} -> ${b} -> ... chains
MAX_INTERPOLATED_CHARS = 100_000      # one value with its ${...} expanded (an "interpolation bomb" doubles per level)
_INTERP = re.compile(r"\$\{([^${}]*)\}")

NAMED_CONFIGS = ("ppo_trainer", "ppo_megatron_trainer", "ppo_veomni_trainer", "ppo_torchtitan_trainer",
                 "dapo_trainer", "dapo_megatron_trainer", "entropy_trainer")
# Hydra's `model_engine=` group choice: the config each engine composes (recipes keep their own on top)
ENGINE_CONFIGS = {"dp": "ppo_trainer", "fsdp": "ppo_trainer", "megatron": "ppo_megatron_trainer",
                  "veomni": "ppo_veomni_trainer", "torchtitan": "ppo_torchtitan_trainer"}


@functools.cache
def _defaults_file() -> dict:
    return json.loads(DEFAULTS_FILE.read_text(encoding="utf-8"))


def verl_version() -> str:
    return _defaults_file()["verl"]


def verl_defaults(megatron: bool = False, name: str | None = None) -> dict[str, Any]:
    """verl's default value of every key of a named config (`ppo_trainer`, `ppo_megatron_trainer`,
    `dapo_trainer`, ...; `megatron` picks ppo_megatron_trainer when no name is given). The file is
    written by tools/verl/defaults.py from verl's generated configs (sdist) and the recipe configs."""
    name = name or ("ppo_megatron_trainer" if megatron else "ppo_trainer")
    return dict(_defaults_file()["configs"][name])


def named_config(name: str, megatron: bool = False) -> str:
    """The named config for a `--config-name`, with the Megatron engine when the inputs ask for it."""
    if megatron:
        name = {"ppo_trainer": "ppo_megatron_trainer", "dapo_trainer": "dapo_megatron_trainer"}.get(name, name)
    return name


def flatten(tree: dict, prefix: str = ""):
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            yield from flatten(v, f"{prefix}{k}.")
        else:
            yield prefix + str(k), v


@dataclass
class VerlConfig:
    """Flat dotted keys -> raw values (interpolations kept), and where each value came from."""
    raw: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)    # inputs that were read but not applied (and why)

    def set(self, key: str, value: Any, origin: str) -> None:
        self.delete(key)   # a value replaces the whole subtree (Hydra merges dicts; a scalar replaces)
        if isinstance(value, dict) and value:
            for k, v in flatten(value, key + "."):
                self.raw[k], self.origin[k] = v, origin
        else:
            self.raw[key], self.origin[key] = value, origin

    def merge(self, key: str, value: Any, origin: str) -> None:
        """Hydra's merge of a YAML value: dicts merge key by key."""
        if isinstance(value, dict) and value:
            for k, v in flatten(value, key + "."):
                self.set(k, v, origin)
        else:
            self.set(key, value, origin)

    def delete(self, key: str) -> bool:
        gone = [k for k in self.raw if k == key or k.startswith(key + ".")]
        for k in gone:
            del self.raw[k]
            self.origin.pop(k, None)
        return bool(gone)

    def is_default(self, key: str, defaults: dict[str, Any]) -> bool:
        return key in defaults and self.raw.get(key, _MISSING) == defaults[key]


def start(defaults: dict[str, Any] | None = None) -> VerlConfig:
    cfg = VerlConfig()
    for k, v in (verl_defaults() if defaults is None else defaults).items():
        cfg.raw[k], cfg.origin[k] = v, DEFAULT
    return cfg


def read_yaml(path: Path, cfg: VerlConfig) -> list[str]:
    """Merge a verl Hydra YAML into `cfg`. Returns the verl named configs its `defaults:` list
    composes (the base mrl convert starts from); its other entries and `hydra:` table are noted."""
    tree = load_yaml(read_text(path, "verl YAML"), str(path))
    if tree is None:
        return []
    if not isinstance(tree, dict):
        raise UserError(f"{path}: a verl config is a YAML mapping, got {type(tree).__name__}")
    bases: list[str] = []
    defaults = tree.pop("defaults", None)
    if isinstance(defaults, list):
        for entry in defaults:
            if isinstance(entry, str) and entry.removesuffix(".yaml") in NAMED_CONFIGS:
                bases.append(entry.removesuffix(".yaml"))
            elif entry != "_self_":
                cfg.notes.append(f"{path.name}: `defaults:` entry {entry!r} is not composed; verl {verl_version()}'s "
                                 "named configs are (mrl/config/verl_defaults.json)")
    if tree.pop("hydra", None) is not None:
        cfg.notes.append(f"{path.name}: `hydra:` is Hydra's own table, not verl's settings")
    for key, value in tree.items():
        cfg.merge(str(key), value, path.name)
    return bases


def parse_value(text: str) -> Any:
    """A Hydra override value: YAML scalars and lists (`[a,b]`, `null`, `1e-6`, quoted strings)."""
    if not text.strip():
        return ""
    try:
        return load_yaml(text, f"the value {text[:40]!r}")
    except UserError as e:
        if "invalid YAML" in str(e):
            return text
        raise


def command_line_overrides(tokens: list[str]) -> list[str]:
    """The override tokens of a verl command line: drops `python3 -m verl.trainer.main_ppo`, keeps
    `key=value`, `+key=value`, `++key=value` and `~key`."""
    out = []
    for tok in tokens:
        if tok.startswith("--") or tok in ("-m",) or ("=" not in tok and not tok.startswith("~")):
            continue   # the program, `-m`, the module, Hydra flags: not settings
        out.append(tok)
    return out


def apply_override(token: str, cfg: VerlConfig, defaults: dict[str, Any], lenient: bool = False) -> None:
    """Apply one Hydra override (`key=value`, `+key=value` adds, `++key=value` adds or sets, `~key`
    deletes). `lenient`: on a partial config (the inputs alone), missing and existing keys are fine."""
    if token.startswith("~"):
        key = token[1:].split("=", 1)[0]
        if not cfg.delete(key) and not lenient:
            raise UserError(f"{COMMAND_LINE}: {token}: no key {key} to delete")
        return
    key, _, text = token.partition("=")
    plus = len(key) - len(key.lstrip("+"))
    key = key.lstrip("+").strip()
    if not key:
        raise UserError(f"{COMMAND_LINE}: {token!r}: an override is key=value")
    exists = (key in cfg.raw and cfg.raw[key] is not None) or any(k.startswith(key + ".") for k in cfg.raw)
    if plus == 1 and exists and not lenient:     # Hydra adds over a null value (verl's router_replay example)
        cfg.notes.append(f"{token}: +{key} adds a key, and verl {verl_version()} already has {key} (Hydra would "
                         f"refuse it: the script was written for another verl version); read as ++{key}")
    cfg.set(key, parse_value(text), COMMAND_LINE)


@dataclass
class ScriptInput:
    """The trainer command of a launch script: its overrides (unknown values marked), the named
    config it composes, and what the reader noticed."""
    path: Path
    line: int
    module: str
    tokens: list[str]
    config_name: str | None
    notes: list[str]
    describe: Any          # text with unknown-value markers -> readable text
    yamls: list[Path] = field(default_factory=list)    # the --config-name YAML, when it is the user's own


def read_script(path: Path) -> ScriptInput:
    """The trainer command of a shell script, read as bash would run it (mrl/convert/shell.py)."""
    from mrl.convert.shell import ENTRY_POINTS, MARK, REFUSED_ENTRY_POINTS, read_script_text
    from mrl.convert.shell_lex import ShellError

    text = read_text(path, "shell script")
    try:
        found = read_script_text(text, path)
    except ShellError as e:
        refused = _static_refusal(text, REFUSED_ENTRY_POINTS)
        if refused is None and not re.search(r"-m\s+(verl|recipe)\.|main_(ppo|dapo|entropy)\.py", text):
            raise UserError(f"{path}: no verl trainer command in this script (python3 -m verl.trainer.main_ppo ...)")
        raise UserError(f"{path} line {e.line}: {refused or e.message}")
    cmd = found.command
    if cmd is None:
        refused = _static_refusal(text, REFUSED_ENTRY_POINTS)
        if refused:
            raise UserError(f"{path}: {refused}")
        if found.exit_line is not None:
            raise UserError(f"{path} line {found.exit_line}: the script exits before it runs verl's trainer "
                            "(arguments or variables it needs are missing: give them in the environment)")
        raise UserError(f"{path}: no verl trainer command (python3 -m verl.trainer.main_ppo, "
                        f"{', '.join(m for m in ENTRY_POINTS if m.startswith('recipe.'))}) in this script")
    if cmd.refused:
        raise UserError(f"{path} line {cmd.line}: {cmd.refused}")
    tokens, config_name, notes = [], ENTRY_POINTS[cmd.module], list(found.notes)
    config_dirs: list[str] = []
    args = list(cmd.args)
    while args:
        tok = args.pop(0)
        flag, eq, value = tok.partition("=")
        if flag in ("--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd"):
            if not eq:
                value = args.pop(0) if args else ""
            if MARK in value:
                raise UserError(f"{path} line {cmd.line}: {flag} is {found.describe(value)}, which mrl convert "
                                "cannot know: give it in the environment")
            if flag in ("--config-name", "-cn"):
                config_name = value.removesuffix(".yaml").removesuffix(".yml")
            else:
                config_dirs.append(value)
            continue
        if tok.startswith("-"):
            notes.append(f"{path.name} line {cmd.line}: {tok} is a flag of the program, not a setting")
            continue
        if tok.startswith("hydra.") or tok.startswith("+hydra."):
            notes.append(f"{tok}: Hydra's own setting, not verl's")
            continue
        if "=" not in tok and not tok.startswith("~"):
            notes.append(f"{path.name} line {cmd.line}: {found.describe(tok)!r} is not a key=value override")
            continue
        tokens.append(tok)
    yamls: list[Path] = []
    if config_name not in NAMED_CONFIGS:    # a config of the user's own, next to the script or in a config dir
        where = [Path(d) if Path(d).is_absolute() else path.parent / d for d in config_dirs] + [path.parent]
        found_yaml = next((d / f"{config_name}{ext}" for d in where for ext in (".yaml", ".yml")
                           if (d / f"{config_name}{ext}").is_file()), None)
        if found_yaml is None:
            raise UserError(f"{path} line {cmd.line}: --config-name {config_name}: not one of verl's named configs "
                            f"({', '.join(NAMED_CONFIGS)}) and no {config_name}.yaml in "
                            f"{', '.join(str(d) for d in where)}: give that YAML to mrl convert with the script")
        yamls.append(found_yaml)
        config_name = None
    elif config_dirs:
        notes.append(f"--config-path {config_dirs[0]}: {config_name} is verl {verl_version()}'s own named config")
    return ScriptInput(path, cmd.line, cmd.module, tokens, config_name, notes, found.describe, yamls)


def _static_refusal(text: str, refused: dict[str, str]) -> str | None:
    """A script that runs a trainer mrl convert does not read, found in its text (when the script
    cannot be followed to that command)."""
    for module, why in refused.items():
        if re.search(rf"-m\s+{re.escape(module)}\b", text):
            return f"runs {module}: {why}"
    return None


# ---- interpolations -----------------------------------------------------------------------------

def resolve(cfg: VerlConfig) -> tuple[dict[str, Any], dict[str, str]]:
    """Every value with `${...}` interpolations resolved: (values, unresolved key -> why)."""
    done: dict[str, Any] = {}
    unresolved: dict[str, str] = {}

    def lookup(key: str, stack: tuple[str, ...]) -> Any:
        if key in done:
            return done[key]
        if key in stack:
            raise _Unresolved(f"interpolation cycle: {' -> '.join((*stack, key))}")
        if len(stack) > MAX_INTERPOLATION_DEPTH:
            raise UserError(f"{stack[0]}: interpolations nested more than {MAX_INTERPOLATION_DEPTH} deep; "
                            "mrl convert refuses it")
        if key not in cfg.raw:
            sub = {k[len(key) + 1:]: k for k in cfg.raw if k.startswith(key + ".")}
            if not sub:
                return _MISSING
            return {short: lookup(full, stack) for short, full in sub.items()}
        value = value_of(key, cfg.raw[key], (*stack, key))
        done[key] = value
        return value

    def value_of(key: str, value: Any, stack: tuple[str, ...]) -> Any:
        if isinstance(value, list):
            return [value_of(key, v, stack) for v in value]
        if not isinstance(value, str) or "${" not in value:
            return value
        whole = _INTERP.fullmatch(value.strip())
        if whole:
            return expression(key, whole.group(1), stack)
        pieces, size, last = [], 0, 0
        for m in _INTERP.finditer(value):
            piece = value[last:m.start()] + str(expression(key, m.group(1), stack))
            size += len(piece)
            if size > MAX_INTERPOLATED_CHARS:     # an "interpolation bomb": refused, not built
                raise UserError(f"{stack[0]}: its interpolations expand past {MAX_INTERPOLATED_CHARS} characters; "
                                "mrl convert refuses it")
            pieces.append(piece)
            last = m.end()
        return "".join(pieces) + value[last:]

    def expression(key: str, expr: str, stack: tuple[str, ...]) -> Any:
        expr = expr.strip()
        if expr.startswith("oc.select:"):
            target, _, default = expr[len("oc.select:"):].partition(",")
            found = lookup(_absolute(key, target.strip()), stack)
            return parse_value(default.strip()) if found is _MISSING else found
        if expr.startswith("oc.env:"):
            name, _, default = expr[len("oc.env:"):].partition(",")
            if name.strip() in os.environ:
                return os.environ[name.strip()]
            if default:
                return parse_value(default.strip())
            raise _Unresolved(f"${{{expr}}}: environment variable {name.strip()} is not set")
        if ":" in expr:
            raise _Unresolved(f"${{{expr}}}: resolver {expr.split(':', 1)[0]} is not known to mrl convert")
        found = lookup(_absolute(key, expr), stack)
        if found is _MISSING:
            raise _Unresolved(f"${{{expr}}}: no key {_absolute(key, expr)}")
        return found

    for key in list(cfg.raw):
        try:
            lookup(key, ())
        except _Unresolved as e:
            unresolved[key] = str(e)
            done[key] = cfg.raw[key]
    return done, unresolved


class _Unresolved(Exception):
    pass


def _absolute(key: str, target: str) -> str:
    """`${.x}` is a sibling of `key`, `${..x}` one level up; anything else is absolute."""
    if not target.startswith("."):
        return target
    dots = len(target) - len(target.lstrip("."))
    parent = key.split(".")[:-dots]
    return ".".join([*parent, target[dots:]])
