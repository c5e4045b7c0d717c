"""Where a command may write: one check, run before any work, by every command that writes a
file or a directory the user names (`mrl data`, `mrl generate --out`, `mrl eval --json`,
`mrl convert -o`, `mrl merge`, `mrl compare --out`).

An output is refused, in one line naming it, when it
- is one of the command's inputs, or (`sources`) a file inside its source data: `mrl data`
  writing into the directory it reads must not replace the `train.parquet` it reads;
- lies inside a checkpoint root (`mrl.checkpoint.store.root_containing`): a file there would
  damage a checkpoint (`--out .../step_*/common.pt`), or retention would delete it;
- already exists, unless `force` (`--force`): a file of another run or dataset is not replaced
  without a word (a directory output: the files the command would write there);
- is the wrong kind: a file where a directory is expected, or a directory where a file is;
- has a parent that is a file.
Paths are compared resolved (symlinks followed), so a link does not get around the checks.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Literal

from mrl.errors import UserError


def _resolved(path: str | os.PathLike) -> Path:
    """`path` absolute with every link followed before the `..` after it, as `open` reads it."""
    return Path(path).resolve()


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def check_output(path: str | os.PathLike, *, what: str, kind: Literal["file", "dir"] = "file",
                 inputs: Iterable[str | os.PathLike] = (), sources: Iterable[str | os.PathLike] = (),
                 writes: Iterable[str] = (), force: bool = False) -> Path:
    """`path` when the command may write it (see the module docstring), else a `UserError` starting
    with `what` (e.g. "mrl generate --out"). `kind="dir"`: `writes` are the names of the files the
    command writes inside it (checked one by one). `inputs`: files the command reads; `sources`:
    files or directories of data no output may land in."""
    out = _resolved(path)
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            raise UserError(f"{what} {path}: {parent} is a file, not a directory")
    if kind == "dir" and out.exists() and not out.is_dir():
        raise UserError(f"{what} {path}: is a file; expected a directory (the command writes files into it)")
    if kind == "file" and out.is_dir():
        raise UserError(f"{what} {path}: is a directory; expected a file name")
    from mrl.checkpoint.store import root_containing

    root = root_containing(out)
    if root is not None:
        raise UserError(f"{what} {path}: is inside the checkpoint root {root}; writing there would damage a "
                        "checkpoint (or retention would delete it): write it elsewhere")
    targets = [out / name for name in writes] if kind == "dir" else [out]
    ins = [_resolved(p) for p in inputs]
    srcs = [_resolved(p) for p in sources]
    if kind == "dir" and out in ins:
        raise UserError(f"{what} {path}: is an input of this command; write the output elsewhere")
    for target in targets:
        if target in ins:
            raise UserError(f"{what} {path}: is an input of this command ({target}); write the output elsewhere")
        source = next((s for s in srcs if _within(target, s)), None)
        if source is not None and target.exists():
            raise UserError(f"{what} {path}: would replace {target}, a file of the source data {source}; "
                            "write the output elsewhere")
        if target.exists() and not force:
            raise UserError(f"{what} {path}: {target} already exists; pass --force to replace it")
    return Path(path)
