"""Reading job files: TOML within bounds, the line of every key (for `file:line:` messages), and
`extends` chains (a base file, its keys merged under the child's; `unset` drops inherited keys)."""
from __future__ import annotations

import os
import re
import stat
import tomllib
from pathlib import Path
from typing import Any

from mrl.config.report import Origin, Report
from mrl.config.suggest import explain_unknown
from mrl.schema.section import all_keys
from mrl.schema.value import kind_of


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


def display(path: Path) -> str:
    """The path as the user would type it: relative to the working directory when inside it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return str(path)
    return str(path) if rel.startswith("..") else rel


def flatten(raw: dict, prefix: str = ""):
    for k, v in raw.items():
        yield prefix + k, v
        if isinstance(v, dict):
            yield from flatten(v, f"{prefix}{k}.")


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
    shown = display(path)
    if path in chain:
        cycle = " -> ".join(display(p) for p in (*chain, path))
        report.error("extends", f"extends cycle: {cycle}", Origin(display(chain[-1])))
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
    own = {k: Origin(shown, lines.get(k)) for k, _ in flatten(raw)}
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
        report.error("extends", f"file {base_name!r} not found (looked for {display(base_path)})", here)
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
