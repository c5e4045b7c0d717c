"""Load a TOML job spec: `extends` chains, dotted overrides, strict typed build, all errors at once.

Every problem is reported as one line, `file:line: dotted.key: message`, and loading collects all
of them before failing, so a spec with three mistakes shows three lines.
"""
from __future__ import annotations

import os
import re
import stat
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mrl.schema.section import all_keys, fields_of, optional_inner, section_of, tables_of, union_members
from mrl.schema.value import ValueProblem, check_range, convert, describe, kind_of
from mrl.config.suggest import explain_unknown
from mrl.errors import SpecError

COMMAND_LINE = "command line"


@dataclass(frozen=True)
class Origin:
    """Where a value was set: a file and line, or the command line."""

    file: str
    line: int | None = None

    def __str__(self) -> str:
        return f"{self.file}:{self.line}" if self.line else self.file


@dataclass
class Report:
    """Problems and warnings found while loading, each located at a dotted key."""

    main_file: str
    origins: dict[str, Origin] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    bad_keys: set[str] = field(default_factory=set)

    def where(self, key: str) -> Origin:
        parts = key.split(".")
        while parts:
            origin = self.origins.get(".".join(parts))
            if origin is not None:
                return origin
            parts.pop()
        return Origin(self.main_file)

    def error(self, key: str, message: str, origin: Origin | None = None) -> None:
        self.problems.append(f"{origin or self.where(key)}: {key}: {message}")

    def warn(self, key: str, message: str) -> None:
        self.warnings.append(f"{self.where(key)}: {key}: {message}")


# ---- TOML files, line numbers and extends ------------------------------------------------------

_BARE = r"[A-Za-z0-9_-]+"
_QUOTED = r'"[^"]*"|\'[^\']*\''
_KEY_PART = rf"(?:{_BARE}|{_QUOTED})"
_DOTTED = rf"{_KEY_PART}(?:\s*\.\s*{_KEY_PART})*"
_HEADER_RE = re.compile(rf"^\s*\[\[?\s*({_DOTTED})\s*\]\]?\s*(?:#.*)?$")
_ASSIGN_RE = re.compile(rf"^\s*({_DOTTED})\s*=\s*(.*)$")
_INLINE_KEY_RE = re.compile(rf"[{{,]\s*({_DOTTED})\s*=")


def _split_key(key: str) -> list[str]:
    return [p.strip().strip("\"'") for p in re.findall(_KEY_PART, key)]


def key_lines(text: str) -> dict[str, int]:
    """Dotted key -> line number (1-based) of its first definition, from the raw TOML text.

    tomllib does not report positions, so this scans headers and `key = value` lines; keys in
    inline tables get the line of the table.
    """
    lines: dict[str, int] = {}
    table: list[str] = []
    for n, line in enumerate(text.splitlines(), start=1):
        m = _HEADER_RE.match(line)
        if m:
            table = _split_key(m.group(1))
            lines.setdefault(".".join(table), n)
            continue
        m = _ASSIGN_RE.match(line)
        if not m:
            continue
        key = table + _split_key(m.group(1))
        lines.setdefault(".".join(key), n)
        rest = m.group(2)
        if rest.lstrip().startswith("{"):
            for sub in _INLINE_KEY_RE.finditer(rest):
                lines.setdefault(".".join(key + _split_key(sub.group(1))), n)
    return lines


def _display(path: Path) -> str:
    """The path as the user would type it: relative to the working directory when inside it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return str(path)
    return str(path) if rel.startswith("..") else rel


def _flatten(raw: dict, prefix: str = ""):
    for k, v in raw.items():
        yield prefix + k, v
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}.")


def _merge(base: dict, child: dict) -> dict:
    out = dict(base)
    for k, v in child.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


MAX_SPEC_BYTES = 1 << 20   # a job file (or a file it extends) larger than this is refused unread
_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def file_problem(path: Path) -> str | None:
    """Why `path` cannot be a job file without reading it (not a regular file: a FIFO would
    block, /dev/zero never ends; larger than `MAX_SPEC_BYTES`), or None."""
    try:
        st = os.stat(path)
    except OSError:
        return None   # the reader says what is wrong (missing, unreadable)
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
        return f"is {kind}, not a regular file (job files are read only from regular files)"
    if st.st_size > MAX_SPEC_BYTES:
        return f"is {st.st_size} bytes; a job file may be at most {MAX_SPEC_BYTES} bytes"
    return None


def _read_bounded(path: Path) -> str:
    """The UTF-8 text of the regular file `path`, opened without blocking and read to at most
    `MAX_SPEC_BYTES` (it may not have turned into something else since `file_problem`)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(0, "not a regular file")
        data = f.read(MAX_SPEC_BYTES + 1)
    if len(data) > MAX_SPEC_BYTES:
        raise OSError(0, f"more than {MAX_SPEC_BYTES} bytes")
    return data.decode("utf-8")


def read_spec_file(path: Path, report: Report, chain: tuple[Path, ...] = ()) -> dict | None:
    """Raw dict of `path` with its `extends` chain merged in (child wins); records origins."""
    path = path.resolve()
    shown = _display(path)
    if path in chain:
        cycle = " -> ".join(_display(p) for p in (*chain, path))
        report.error("extends", f"extends cycle: {cycle}", Origin(_display(chain[-1])))
        return None
    problem = file_problem(path)
    if problem:
        report.problems.append(f"{shown}: {problem}")
        return None
    try:
        text = _read_bounded(path)
    except UnicodeDecodeError as e:
        report.problems.append(f"{shown}: not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r}); "
                               "save the job file as UTF-8")
        return None
    except FileNotFoundError:
        report.problems.append(f"{shown}: job file not found")
        return None
    except OSError as e:
        report.problems.append(f"{shown}: cannot read: {e.strerror}")
        return None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        hint = ("; a verl config? `mrl convert " + shown + " -o job.toml` writes the mrl job"
                if path.suffix in (".yaml", ".yml") else "")
        report.problems.append(f"{shown}: invalid TOML: {e}{hint}")
        return None
    lines = key_lines(text)
    unset = raw.pop("unset", None)
    own = {k: Origin(shown, lines.get(k)) for k, _ in _flatten(raw)}
    base_name = raw.pop("extends", None)
    if unset is not None and not _valid_unset(unset, base_name, report, Origin(shown, lines.get("unset"))):
        return None
    if base_name is None:
        report.origins.update(own)
        return raw
    here = Origin(shown, lines.get("extends"))
    if not isinstance(base_name, str):
        report.error("extends", f"must be a string (a path relative to {shown}), got {kind_of(base_name)}", here)
        return None
    base_path = path.parent / base_name
    if not base_path.exists():
        report.error("extends", f"file {base_name!r} not found (looked for {_display(base_path)})", here)
        return None
    problem = file_problem(base_path)
    if problem:
        report.error("extends", f"{base_name!r} {problem}", here)
        return None
    base = read_spec_file(base_path, report, (*chain, path))
    if base is None:
        return None
    for key in unset or ():   # back to the schema's default (None for an optional key)
        _drop(base, key.split("."))
        report.origins.pop(key, None)
    report.origins.update(own)  # the child's lines win over the base's
    return _merge(base, raw)


def _valid_unset(unset: Any, base_name: Any, report: Report, here: Origin) -> bool:
    """`unset = ["section.key", ...]` in a file that `extends` another: known dotted keys only."""
    from mrl.config.job import JobSpec
    from mrl.config.sft_job import SFTJobSpec

    if base_name is None:
        report.error("unset", "only means something in a file that `extends` another (it removes keys the base "
                              "set)", here)
        return False
    if not isinstance(unset, list) or not all(isinstance(k, str) for k in unset):
        report.error("unset", f"must be a list of dotted keys (e.g. [\"rollout.max_model_len\"]), got "
                              f"{kind_of(unset)}", here)
        return False
    valid = set(all_keys(JobSpec)) | set(all_keys(SFTJobSpec))
    for key in unset:
        if key not in valid:
            parent = key.rpartition(".")[0]
            siblings = [k.rsplit(".", 1)[-1] for k in valid if k.rpartition(".")[0] == parent]
            report.error("unset", f"{key!r}: " + explain_unknown(key, siblings, valid), here)
            return False
    return True


def _drop(raw: dict, parts: list[str]) -> None:
    """Remove the dotted key `parts` from a raw spec dict (nothing when absent)."""
    for part in parts[:-1]:
        raw = raw.get(part)
        if not isinstance(raw, dict):
            return
    raw.pop(parts[-1], None)


# ---- command-line overrides ---------------------------------------------------------------------

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


# ---- paths: relative to the file that sets them -------------------------------------------------

# Keys holding paths, by kind. "file": a path (or list of paths). "ref": 'path/file.py:function'
# (a 'module:function' or 'reasoning_gym:task' is left alone). "model": a local directory, or a
# Hugging Face Hub id / builtin preset, left alone: a relative value is a path when it exists next
# to the file, starts with ./ or ../, or has more than one '/' (a Hub id is 'org/name').
PATH_KEYS: dict[str, str] = {
    "job.output_dir": "file",
    "data.train_files": "file",
    "data.val_files": "file",
    "data.generator": "ref",
    "reward.function": "ref",
    "rollout.multi_turn.tools": "ref",
    "rollout.multi_turn.tool_config": "file",
    "model.path": "model",
    "model.tokenizer": "model",
    "critic.model_path": "model",
    "ref.model_path": "model",
    "reward.model_path": "model",
    "checkpoint.dir": "file",
    "checkpoint.load_from": "file",
    "actor.lora.adapter_path": "file",
    "sft.lora.adapter_path": "file",
}
SOURCE_PATH_KEYS = {"function": "ref", "model_path": "model"}  # inside each [[reward.sources]] table
PATHS_HELP = ("paths in a job file are relative to that file; paths in command-line overrides to the working "
              "directory")


def _base_dir(origin: Origin) -> Path:
    return Path.cwd() if origin.file == COMMAND_LINE else Path(origin.file).resolve().parent


def _resolve_path(value: Any, kind: str, base: Path) -> Any:
    if not isinstance(value, str) or not value:
        return value
    if kind == "ref":
        target, sep, func = value.rpartition(":")
        if not sep or not target.endswith(".py") or os.path.isabs(target):
            return value
        return f"{(base / target).resolve()}:{func}"
    if os.path.isabs(value) or value.startswith("builtin:"):
        return value
    if kind == "model":
        here = base / value
        if not (here.exists() or value.startswith(("./", "../")) or value.count("/") > 1):
            return value
    return str((base / value).resolve())


def resolve_paths(raw: dict, report: Report) -> None:
    """Rewrite the path-valued keys of `raw` to absolute paths, each against the directory of the
    file that set it (or the working directory for a command-line override)."""
    for key, kind in PATH_KEYS.items():
        *parents, leaf = key.split(".")
        node = raw
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            continue
        base = _base_dir(report.where(key))
        value = node[leaf]
        if isinstance(value, list):
            node[leaf] = [_resolve_path(v, kind, base) for v in value]
        else:
            node[leaf] = _resolve_path(value, kind, base)
    sources = raw.get("reward", {}).get("sources") if isinstance(raw.get("reward"), dict) else None
    if isinstance(sources, list):
        base = _base_dir(report.where("reward.sources"))
        for table in sources:
            if isinstance(table, dict):
                for k, kind in SOURCE_PATH_KEYS.items():
                    if k in table:
                        table[k] = _resolve_path(table[k], kind, base)


# ---- typed build --------------------------------------------------------------------------------

def build_section(cls, raw: Any, prefix: str, report: Report, valid: list[str]):
    """Instance of section `cls` from `raw`, reporting every problem in it.

    A field with a bad value falls back to its default (its key goes in `report.bad_keys`) so that
    the cross-section checks still run and the user sees every error at once. Returns None only
    when the section cannot be built at all (a required key is missing or bad).
    """
    name = prefix[:-1] if prefix else "job spec"
    if not isinstance(raw, dict):
        report.error(name, f"must be a table, got {kind_of(raw)}")
        report.bad_keys.add(name)
        raw = {}
    fields = fields_of(cls)
    for key in raw:
        if key not in fields:
            dotted = prefix + key
            if isinstance(raw[key], dict) and raw[key]:
                _unknown_table(dotted, raw[key], report, valid, list(fields))
            else:
                report.error(dotted, explain_unknown(dotted, list(fields), valid))
    values = {}
    buildable = True
    for fname, f in fields.items():
        dotted = prefix + fname
        if fname not in raw:
            if f.required:
                report.error(dotted, f"missing required key ({f.meta.get('help') or describe(f.type)})")
                buildable = False
            continue
        sub = section_of(f.type)
        if sub is not None:
            value = build_section(sub, raw[fname], dotted + ".", report, valid)
            if value is None:
                buildable = False
            values[fname] = value
            continue
        elem = tables_of(f.type)
        if elem is not None:   # a list of tables: each built (and reported) as `key[i].field`
            if not isinstance(raw[fname], (list, tuple)):
                report.error(dotted, f"must be a list of tables ([[{dotted}]]), got {kind_of(raw[fname])}")
                report.bad_keys.add(dotted)
                continue
            built = [build_section(elem, item, f"{dotted}[{i}].", report, valid) for i, item in enumerate(raw[fname])]
            if any(b is None for b in built):
                report.bad_keys.add(dotted)
                continue
            values[fname] = tuple(built)
            continue
        try:
            value = convert(raw[fname], f.type)
            check_range(value, f.meta)
        except ValueProblem as e:
            report.error(dotted, str(e))
            report.bad_keys.add(dotted)
            buildable = buildable and not f.required
            continue
        values[fname] = value
    return cls(**values) if buildable else None


def _unknown_table(dotted: str, table: dict, report: Report, valid: list[str], siblings: list[str]) -> None:
    """An unknown table: one line for it (pointing verl sections to `mrl convert`), then one line per
    key inside it, each with its suggestion (verl's `[actor_rollout_ref.actor]` -> `actor.optim.lr`)."""
    from mrl.config.verl_table import verl_table

    if verl_table().rows(dotted + "."):
        report.error(dotted, "unknown table; it is verl's: `mrl convert` turns a verl config into an mrl job, "
                             "and each key below names its mrl counterpart")
    else:
        report.error(dotted, explain_unknown(dotted, siblings, valid).replace("unknown key", "unknown table", 1))
    for leaf, value in _flatten(table, dotted + "."):
        if isinstance(value, dict) and value:
            continue
        parent = leaf.rpartition(".")[0]
        siblings = [k.rsplit(".", 1)[-1] for k in valid if k.rpartition(".")[0] == parent]
        report.error(leaf, explain_unknown(leaf, siblings, valid))


def _about(problem: str, keys: set[str]) -> bool:
    """Whether a formatted problem names one of `keys` (or a key inside one of them)."""
    return any(f" {k}" in problem or f": {k}." in problem for k in keys)


def load(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = (), root=None):
    """Load and validate a job spec. Returns (spec, report); raises SpecError listing every problem."""
    from mrl.config import validate
    from mrl.config.job import JobSpec

    path = Path(path)
    report = Report(main_file=_display(path.resolve()))
    raw = read_spec_file(path, report)
    if raw is None:
        raise SpecError(report.problems[0], problems=report.problems)
    from mrl.config import sft_job   # a job with an [sft] table is an SFT job (`mrl sft`)

    if root is None:
        root = sft_job.SFTJobSpec if sft_job.is_sft_table(raw) else JobSpec
    rules = sft_job if root is sft_job.SFTJobSpec else validate
    apply_overrides(raw, list(overrides), root, report)
    resolve_paths(raw, report)
    spec = build_section(root, raw, "", report, all_keys(root))
    if spec is not None:
        # Cross-section checks run even after field errors (bad values fell back to defaults),
        # but a check about a key whose value was rejected would only repeat that error.
        spec = rules.resolve(spec, default_name=path.stem)
        checks = Report(main_file=report.main_file, origins=report.origins)
        rules.check(spec, checks)
        report.problems += [p for p in checks.problems if not _about(p, report.bad_keys)]
        report.warnings += checks.warnings
    if report.problems:
        raise SpecError(report.problems[0], problems=report.problems)
    return spec, report
