"""Prompt rows from parquet files (pyarrow), with the column names the job sets."""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq

from mrl.data.rows import Columns, PromptRow, rows_from_records, verl_answer_key
from mrl.errors import UserError


def schema_problem(name: str, columns: Columns, *, require_answer: bool = True) -> str | None:
    """Why the parquet file `name` cannot give prompt rows (missing, unreadable, no prompt or
    answer column), read from its schema alone; None when it can. `mrl validate` runs it on
    every data file, so a bad validation file fails before training, not at the first validation."""
    path = Path(name)
    if not path.is_file():
        return f"{name!r} does not exist"
    try:
        names = pq.read_schema(path).names
    except (pa.ArrowInvalid, OSError) as e:
        return f"{name!r} is not a readable parquet file ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    answer = verl_answer_key(columns.answer, names)
    needed = [(columns.prompt, "data.prompt_key")] + ([(answer, "data.answer_key")] if require_answer else [])
    for col, key in needed:
        if col not in names and col.split(".")[0] not in names:
            return f"{name!r} has no column {col!r} ({key}); columns: {', '.join(names)}"
    return None


def read_parquet_rows(
    files: tuple[str, ...] | list[str],
    *,
    columns: Columns,
    bad_rows: Literal["warn", "error"] = "warn",
    require_answer: bool = True,
    stats: Counter | None = None,
) -> list[PromptRow]:
    """Rows of every file in order. A row's data source defaults to its file's stem.

    A missing file, an unreadable file or a missing prompt/answer column is a `UserError` naming
    the file and listing the columns it has; bad rows follow `bad_rows` (see `rows_from_records`).
    """
    rows: list[PromptRow] = []
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise UserError(f"{name}: parquet file not found (data.train_files / data.val_files)")
        try:
            table = pq.read_table(path)
        except (pa.ArrowInvalid, OSError) as e:
            raise UserError(f"{name}: not a readable parquet file: {e}") from None
        answer = verl_answer_key(columns.answer, table.column_names)
        needed = [(columns.prompt, "data.prompt_key")] + ([(answer, "data.answer_key")] if require_answer else [])
        for col, key in needed:
            if col not in table.column_names and col.split(".")[0] not in table.column_names:
                raise UserError(f"{name}: no column {col!r} ({key}); columns: {', '.join(table.column_names)}")
        rows += rows_from_records(table.to_pylist(), columns=columns, default_source=path.stem, where=name,
                                  bad_rows=bad_rows, require_answer=require_answer, stats=stats)
    return rows
