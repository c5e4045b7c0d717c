"""Generated tasks from reasoning-gym (`data.generator = "reasoning_gym:<task>"`).

reasoning-gym builds procedural datasets (`chain_sum`, `basic_arithmetic`, `gsm_symbolic`,
`countdown`, ...) deterministically from a seed, and each task has an exact scorer. A generated row
keeps its reasoning-gym entry (question, answer, metadata) in `extra["reasoning_gym"]`, so the
`reasoning_gym` reward can call the task's own scorer on it.
"""
from __future__ import annotations

import difflib
import functools
from typing import Any, Callable

from mrl.errors import UserError

PREFIX = "reasoning_gym:"
EXTRA_KEY = "reasoning_gym"  # extra["reasoning_gym"] = {"task": name, "entry": reasoning-gym entry}


def is_gym_generator(ref: str | None) -> bool:
    return bool(ref) and ref.startswith(PREFIX)


def task_names() -> list[str]:
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def task_problem(task: str) -> str | None:
    """Why `task` is not a reasoning-gym task (with the closest name), or None."""
    names = task_names()
    if task in names:
        return None
    close = difflib.get_close_matches(task, names, n=1)
    return f"reasoning-gym has no task {task!r}" + (f"; did you mean {close[0]!r}?" if close else "")


def gym_records(task: str, size: int, seed: int, *, prompt_key: str = "prompt", answer_key: str = "answer",
                source_key: str = "data_source", **task_options: Any) -> list[dict]:
    """`size` records of `task` under the job's column names; the same (seed, options) give the same rows."""
    import reasoning_gym

    problem = task_problem(task)
    if problem:
        raise UserError(f"data.generator: {problem}")
    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **task_options)
    except (TypeError, AssertionError, ValueError) as e:
        raise UserError(f"data.generator_kwargs: reasoning-gym task {task!r} rejects {task_options}: {e}") from None
    return [{prompt_key: entry["question"], answer_key: entry["answer"], source_key: f"reasoning_gym/{task}",
             EXTRA_KEY: {"task": task, "entry": entry}} for entry in dataset]


@functools.cache
def scorer(task: str) -> Callable[[str | None, dict], float]:
    """reasoning-gym's exact scorer for `task`: `(extracted answer or None, entry) -> score in [0, 1]`."""
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def extract_answer(response: str, tag: str = "answer") -> str | None:
    """Content of the last `<tag>...</tag>` in `response` (reasoning-gym's convention), or None."""
    from reasoning_gym.utils import extract_answer as _extract

    return _extract(response, tag_name=tag)
