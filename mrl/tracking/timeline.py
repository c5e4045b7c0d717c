"""A step's wall-clock stage timestamps turned into durations before they are logged.

The train step notes when its training started and ended (`time/train_started_at`,
`time/train_ended_at`, unix seconds) and, with a separate rollout placement, when the rollout
side generated the step's responses (`time/rollout_generate_started_at`, `..._ended_at`). A
timestamp plotted as a metric is a line of ever-growing 1.7e9 values, so no backend receives
them: `StepTimeline.durations` replaces them by what they are taken for:

- `time/train`: seconds the trainer spent on the step after taking its rollouts (log-probs,
  advantages, updates);
- `time/step_period`: seconds between the end of the previous step's training and this one's
  (the rate a run makes progress at, waits included);
- `time/rollout_overlap`: seconds of this step's rollout generation that ran while the previous
  step trained (separate placement; > 0 is the overlap one-step off-policy training buys).

The previous step's timestamps are kept in memory: the first step after a start or a resume has
no `time/step_period` or `time/rollout_overlap`.
"""
from __future__ import annotations

from typing import Mapping, Optional

TRAIN_STARTED, TRAIN_ENDED = "time/train_started_at", "time/train_ended_at"
GENERATE_STARTED, GENERATE_ENDED = "time/rollout_generate_started_at", "time/rollout_generate_ended_at"
# durations derived here: not stages of their own (the Prometheus stage histograms leave them out)
DERIVED = ("train", "step_period", "rollout_overlap")


def is_timestamp(key: str) -> bool:
    return key.startswith("time/") and key.endswith("_at")


def overlap_s(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Seconds two wall-clock intervals `(start, end)` have in common (0 when disjoint)."""
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


class StepTimeline:
    """Per run (rank 0 logs): each step's timestamps in, its durations out."""

    def __init__(self):
        self.previous_train: Optional[tuple[float, float]] = None   # (started, ended) of the last step

    def durations(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """`metrics` without its `time/*_at` timestamps, with the durations derived from them."""
        out = {k: v for k, v in metrics.items() if not is_timestamp(k)}
        if TRAIN_STARTED not in metrics or TRAIN_ENDED not in metrics:
            return out
        train = (float(metrics[TRAIN_STARTED]), float(metrics[TRAIN_ENDED]))
        out["time/train"] = train[1] - train[0]
        if self.previous_train is not None:
            out["time/step_period"] = train[1] - self.previous_train[1]
            if GENERATE_STARTED in metrics and GENERATE_ENDED in metrics:
                generated = (float(metrics[GENERATE_STARTED]), float(metrics[GENERATE_ENDED]))
                out["time/rollout_overlap"] = overlap_s(generated, self.previous_train)
        self.previous_train = train
        return out
