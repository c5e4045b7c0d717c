"""Sample generations as MLflow tables: what the policy wrote, for what prompt, scored how.

Every `trainer.log_samples_every` steps (and at the last step) the trainer appends up to
`SAMPLE_ROWS` of rank 0's responses of that step to the run's `samples/train.json` table, and
every validation pass appends to `samples/validation.json` (MLflow's artifact view shows them as
tables; one `step` column tells the steps apart). Decoding happens only on those steps.
"""
from __future__ import annotations

from typing import Any, Sequence

SAMPLE_ROWS = 16   # responses per table per step: enough to read, small enough to log every few steps


def wants_samples(every: int, step: int, total_steps: int) -> bool:
    """Whether `step` logs a training sample table (`every` = 0 turns tables off)."""
    return every > 0 and (step % every == 0 or step == total_steps)


def sample_rows(step: int, items: Sequence[Any], responses: Sequence[Any], scores: Sequence[float], n: int,
                tokenizer, limit: int = SAMPLE_ROWS) -> dict[str, list]:
    """Columns of a sample table: the first `limit` responses (prompt-major, `n` per item)."""
    cols: dict[str, list] = {k: [] for k in ("step", "data_source", "prompt", "response", "answer", "score",
                                             "response_tokens", "finish_reason")}
    for i, r in enumerate(responses[:limit]):
        it = items[i // n]
        cols["step"].append(step)
        cols["data_source"].append(it.data_source)
        cols["prompt"].append(it.text)
        cols["response"].append(tokenizer.decode(list(r.token_ids), skip_special_tokens=True))
        cols["answer"].append(str(it.answer))
        cols["score"].append(float(scores[i]))
        cols["response_tokens"].append(len(r.token_ids))
        cols["finish_reason"].append(str(getattr(r, "finish_reason", "")))
    return cols
