"""Prompt generators: deterministic, offline sources of (prompt, answer) rows for smoke runs.

A job names one as `data.generator = "module:function"`; the function takes `(size, seed)` and
returns rows with the `data.prompt_key` and `data.answer_key` columns.
"""
from __future__ import annotations

import random


def arithmetic(size: int, seed: int) -> list[dict]:
    """`size` sums/differences of two small integers, e.g. "What is 17 + 5? Answer:" -> "22"."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        op = rng.choice("+-")
        rows.append({"prompt": f"What is {a} {op} {b}? Answer:", "answer": str(a + b if op == "+" else a - b)})
    return rows
