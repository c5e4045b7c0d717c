"""A verl `main_ppo` configuration as one flat dict: verl's defaults, then YAML files, then
command-line overrides, with Hydra interpolations resolved.

verl composes its config with Hydra: a YAML (often one verl dumped, holding every default) and
`key=value` / `+key=value` / `++key=value` / `~key` overrides. This module reproduces the parts of
that a converter needs, on flat dotted keys, and records where each value came from.
"""
from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mrl.errors import UserError

DEFAULTS_FILE = Path(__file__).resolve().parents[1] / "config" / "verl_defaults.json"
DEFAULT = "verl default"
COMMAND_LINE = "command line"
_MISSING = object()
_INTERP = re.compile(r"\$\{([^${}]*)\}")
_SHELL_VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


class _Loader(yaml.SafeLoader):
    """YAML as OmegaConf reads it: `1e-6` (no dot) is a float, not a string as in YAML 1.1."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                              re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"),
                              list("-+0123456789."))


def verl_defaults(megatron: bool = False) -> dict[str, Any]:
    """verl's default value of every `main_ppo` key, for the FSDP or the Megatron backend
    (tools/verl/defaults.py writes the file from verl's generated configs)."""
    return json.loads(DEFAULTS_FILE.read_text(encoding="utf-8"))["megatron" if megatron else "fsdp"]


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


def read_yaml(path: Path, cfg: VerlConfig) -> None:
    """Merge a verl Hydra YAML into `cfg` (its `defaults:` list and `hydra:` table are noted, not applied)."""
    try:
        tree = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
    except FileNotFoundError:
        raise UserError(f"{path}: file not found")
    except yaml.YAMLError as e:
        raise UserError(f"{path}: invalid YAML: {str(e).splitlines()[0]}")
    if tree is None:
        return
    if not isinstance(tree, dict):
        raise UserError(f"{path}: a verl config is a YAML mapping, got {type(tree).__name__}")
    for special in ("defaults", "hydra"):
        if special in tree:
            tree.pop(special)
            cfg.notes.append(f"{path.name}: `{special}:` is Hydra's composition list; verl's defaults are "
                             "applied anyway (mrl/config/verl_defaults.json)")
    for key, value in tree.items():
        cfg.merge(str(key), value, path.name)


def parse_value(text: str) -> Any:
    """A Hydra override value: YAML scalars and lists (`[a,b]`, `null`, `1e-6`, quoted strings)."""
    try:
        return yaml.load(text, Loader=_Loader) if text.strip() else ""
    except yaml.YAMLError:
        return text


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
    exists = key in cfg.raw or any(k.startswith(key + ".") for k in cfg.raw)
    if plus == 1 and exists and not lenient:
        raise UserError(f"{COMMAND_LINE}: {token}: +{key} adds a key, but verl already has {key} (use {key}=... or ++{key}=...)")
    cfg.set(key, parse_value(text), COMMAND_LINE)


def read_script(path: Path) -> list[str]:
    """The override tokens of the `main_ppo` command in a shell script (line continuations joined,
    comments dropped, `NAME=value` shell assignments made before the command substituted)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: file not found")
    text = re.sub(r"\\\n", " ", text)
    variables: dict[str, str] = {}
    for line in text.splitlines():
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError as e:
            raise UserError(f"{path}: cannot parse shell line ({e}): {line.strip()[:80]}")
        if not tokens:
            continue
        if any("main_ppo" in t for t in tokens):
            tokens = tokens[next(i for i, t in enumerate(tokens) if "main_ppo" in t) + 1:]
            return [_substitute(t, variables) for t in command_line_overrides(tokens)]
        assignment = re.fullmatch(r"(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)", " ".join(tokens))
        if assignment and len(tokens) == 1 or (assignment and tokens[0] == "export"):
            variables[assignment.group(1)] = _substitute(assignment.group(2), variables)
    raise UserError(f"{path}: no `verl.trainer.main_ppo` command in this script")


def _substitute(text: str, variables: dict[str, str]) -> str:
    """Shell variables set by the script, else in this environment; unknown ones stay (`mrl convert`
    then asks for the value)."""
    return _SHELL_VAR.sub(lambda m: variables.get(m.group(1), os.environ.get(m.group(1), m.group(0))), text)


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
        return _INTERP.sub(lambda m: str(expression(key, m.group(1), stack)), value)

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
