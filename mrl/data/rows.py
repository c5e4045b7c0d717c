"""Prompt rows: one validated record per prompt, whatever the source (parquet file or generator).

A record is a mapping of column name -> value. `rows_from_records` picks the job's prompt, answer
and data-source columns, keeps every other column as `extra` (passed to the reward), and handles
rows whose prompt or answer is missing, empty or NaN by the job's `data.bad_rows` policy: counted
and dropped ("warn") or a `UserError` naming the row ("error"). Nothing is dropped without a count.

A column name may be dotted to reach into a table-valued column: verl's data keeps the answer at
`reward_model.ground_truth`. With the default answer column ("answer") absent and verl's
`reward_model` column present, that is where the answer is read (`verl_answer_key`).
"""
from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Mapping

from mrl.errors import UserError

log = logging.getLogger(__name__)

Prompt = str | list[dict]  # plain text, or chat messages [{"role": ..., "content": ...}, ...]


@dataclass(frozen=True)
class PromptRow:
    """One prompt before templating: the raw prompt, its ground truth and where it came from."""

    prompt: Prompt
    answer: Any
    data_source: str
    origin: str  # "file.parquet row 17" or "generator row 17", for messages
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Columns:
    """The job's column names (`data.prompt_key`, `data.answer_key`, `data.source_key`)."""

    prompt: str = "prompt"
    answer: str = "answer"
    source: str = "data_source"


VERL_ANSWER = "reward_model.ground_truth"
DEFAULT_ANSWER = "answer"


def lookup(record: Mapping[str, Any], key: str) -> Any:
    """`record[key]`, or for a dotted key the value inside nested tables (None where absent)."""
    if key in record or "." not in key:
        return record.get(key)
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


def verl_answer_key(answer_key: str, columns: Iterable[str]) -> str:
    """`reward_model.ground_truth` when the job keeps the default answer column, the data has no such
    column and has verl's `reward_model` column; else `answer_key` unchanged."""
    columns = set(columns)
    if answer_key == DEFAULT_ANSWER and DEFAULT_ANSWER not in columns and VERL_ANSWER.split(".")[0] in columns:
        return VERL_ANSWER
    return answer_key


def _is_empty(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, float) and math.isnan(value):
        return True
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, (list, tuple, dict)):
        return len(value) == 0
    return False


def prompt_problem(prompt: Any) -> str | None:
    """Why `prompt` is not a usable prompt cell (empty text, or malformed chat messages), or None."""
    if _is_empty(prompt):
        return "empty"
    if isinstance(prompt, str):
        return None
    if not isinstance(prompt, (list, tuple)):
        return f"is {type(prompt).__name__}, not a string or a list of chat messages"
    for i, m in enumerate(prompt):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            return f"message {i} is not a {{role, content}} table"
    if all(_is_empty(m["content"]) for m in prompt):
        return "every message is empty"
    return None


def rows_from_records(
    records: Iterable[Mapping[str, Any]],
    *,
    columns: Columns,
    default_source: str,
    where: str,
    bad_rows: Literal["warn", "error"] = "warn",
    require_answer: bool = True,
    stats: Counter | None = None,
) -> list[PromptRow]:
    """Validated rows from `records` (from `where`, e.g. a file name); bad rows counted in `stats`.

    Counters: `rows_read`, `rows_bad_prompt`, `rows_missing_answer` (only when `require_answer`).
    A missing or null data-source cell falls back to `default_source`.
    """
    counts: Counter = Counter()
    rows = []
    records = list(records)
    if records:
        answer_key = verl_answer_key(columns.answer, records[0].keys())
        if answer_key != columns.answer:
            log.info("%s: verl layout: answers from %r", where, answer_key)
            columns = Columns(prompt=columns.prompt, answer=answer_key, source=columns.source)
    for i, rec in enumerate(records):
        counts["rows_read"] += 1
        origin = f"{where} row {i}"
        prompt = lookup(rec, columns.prompt)
        problem = prompt_problem(prompt)
        counter = "rows_bad_prompt"
        answer = lookup(rec, columns.answer)
        if problem is None and require_answer and _is_empty(answer):
            what = "NaN" if isinstance(answer, float) else "missing"
            problem, counter = f"{what} {columns.answer!r} (data.answer_key)", "rows_missing_answer"
        elif problem is not None:
            problem = f"prompt column {columns.prompt!r} (data.prompt_key) {problem}"
        if problem is not None:
            if bad_rows == "error":
                raise UserError(f"{origin}: {problem} (set data.bad_rows = 'warn' to drop and count such rows)")
            counts[counter] += 1
            continue
        source = rec.get(columns.source)
        extra = {k: v for k, v in rec.items() if k not in (columns.prompt, columns.answer, columns.source)}
        if not isinstance(prompt, str):
            prompt = [dict(m) for m in prompt]
        rows.append(PromptRow(prompt=prompt, answer=answer, origin=origin, extra=extra,
                              data_source=str(source) if not _is_empty(source) else default_source))
    dropped = counts["rows_bad_prompt"] + counts["rows_missing_answer"]
    if dropped:
        log.warning("%s: dropped %d of %d rows (bad prompt: %d, missing answer: %d)", where, dropped,
                    counts["rows_read"], counts["rows_bad_prompt"], counts["rows_missing_answer"])
    if stats is not None:
        stats.update(counts)
    return rows
