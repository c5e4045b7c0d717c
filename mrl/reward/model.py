"""Learned reward model scoring: token sequences in, one scalar per sequence out.

The model side (a Megatron model with a scalar head, read at each sequence's last token) lives in
`mrl.models`; it is handed here as a plain callable `forward(batch of token-id lists) -> scores`,
so this module owns only the call path: token-budget micro-batches, order, and checks.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

ScoreForward = Callable[[list[list[int]]], Sequence[float]]


def micro_batches(lengths: Sequence[int], budget_tokens: int | None) -> list[list[int]]:
    """Consecutive index groups whose padded size (count x longest) fits `budget_tokens`.

    A sequence longer than the budget goes alone. None means one batch.
    """
    if budget_tokens is None:
        return [list(range(len(lengths)))] if lengths else []
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if current and (len(current) + 1) * max(longest, n) > budget_tokens:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups


class RewardModelScorer:
    """Scores sequences (prompt + response token ids) with `forward`, `micro_batch_tokens` at a time.

    `forward` receives a list of token-id lists and returns one score per sequence (a list, or a
    1-D tensor/array). Non-finite scores come back as NaN for the caller to count; a wrong number
    of scores is a bug in the model path and raises.
    """

    def __init__(self, forward: ScoreForward, *, micro_batch_tokens: int | None = None):
        self.forward = forward
        self.micro_batch_tokens = micro_batch_tokens

    def __call__(self, sequences: Sequence[Sequence[int]]) -> list[float]:
        scores = [math.nan] * len(sequences)
        for group in micro_batches([len(s) for s in sequences], self.micro_batch_tokens):
            out = self.forward([list(sequences[i]) for i in group])
            values = out.tolist() if hasattr(out, "tolist") else list(out)
            if len(values) != len(group):
                raise RuntimeError(f"reward model returned {len(values)} scores for {len(group)} sequences")
            for i, v in zip(group, values):
                v = float(v)
                scores[i] = v if math.isfinite(v) else math.nan
        return scores
