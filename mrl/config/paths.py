"""Paths in a job: relative to the file that sets them (command-line overrides: to the working
directory), resolved once when the job loads, so a job runs from any directory."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mrl.config.report import COMMAND_LINE, Origin, Report


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
