"""Console progress: a rich live bar on a terminal, one plain line per step otherwise.

Shows the stage the step is in (rollout, reward, update, ...), the step count, the ETA (from the
mean step time of this process, so a resumed run is not misled by steps it did not run) and the
headline metrics (reward and KL by default). Logs and CI captures get plain lines, no escape codes.
"""
from __future__ import annotations

import math
import sys
import time
from typing import IO, Mapping

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

# Headline slots shown on each step: for each slot, (label, metric key) pairs, and the first key the
# step logged is shown under its own label, so a number is always called what it is: the training
# reward, the validation reward (on steps that validate), and the KL the run optimises against (the
# KL loss, the KL in the reward), else the policy's approximate KL to the behaviour policy.
HEADLINE: tuple[tuple[tuple[str, str], ...], ...] = (
    (("reward", "reward/mean"),),
    (("val_reward", "val/reward_mean"),),
    (("kl_loss", "actor/kl_loss"), ("reward_kl", "kl/reward_kl"), ("approx_kl", "actor/pg_approx_kl")),
    (("loss", "train/loss"),),          # mrl sft
    (("val_loss", "val/loss"),),
)


def _fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}"


def _fmt_value(v: float) -> str:
    return "nan" if v != v else f"{v:.4g}"


class ConsoleProgress:
    """Progress for `total_steps` steps starting after `start_step` (non-zero when resuming)."""

    def __init__(self, total_steps: int, *, start_step: int = 0, file: IO[str] | None = None,
                 force_terminal: bool | None = None, headline=HEADLINE, every_steps: int = 1):
        self.total_steps, self.start_step = total_steps, start_step
        self.every_steps = every_steps  # plain output: a line every N steps and at the last one
        self.file = file if file is not None else sys.stdout
        self.headline = tuple(headline)
        self.console = Console(file=self.file, force_terminal=force_terminal)
        self.live = self.console.is_terminal
        self._t0 = time.monotonic()
        self._stage = "starting"
        self._progress = None
        if self.live:
            self._progress = Progress(TextColumn("[bold]{task.fields[stage]:<10}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("eta {task.fields[eta]}"),
                                      TextColumn("{task.fields[headline]}"), console=self.console, transient=False)
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, stage=self._stage,
                                                 eta="?", headline="")
            self._progress.start()

    def eta_seconds(self, step: int) -> float:
        """Seconds left after `step` at the mean pace of the steps this process ran."""
        ran = step - self.start_step
        if ran <= 0:
            return math.inf
        return (time.monotonic() - self._t0) / ran * max(0, self.total_steps - step)

    def stage(self, name: str) -> None:
        """The step entered stage `name` (live display only; plain output prints one line per step)."""
        self._stage = name
        if self._progress is not None:
            self._progress.update(self._task, stage=name)

    def step_done(self, step: int, metrics: Mapping[str, float]) -> str:
        """Record that `step` (1-based count of finished steps) ended with `metrics`; returns the line shown."""
        picked = [next(((label, key) for label, key in slot if key in metrics), None) for slot in self.headline]
        shown = "  ".join(f"{label} {_fmt_value(float(metrics[key]))}" for label, key in filter(None, picked))
        eta = _fmt_duration(self.eta_seconds(step))
        ran = step - self.start_step
        pace = (time.monotonic() - self._t0) / ran if ran > 0 else math.nan
        line = f"step {step}/{self.total_steps}  {shown}  {pace:.2f}s/step  eta {eta}".replace("    ", "  ")
        if self._progress is not None:
            self._progress.update(self._task, completed=step, eta=eta, headline=shown)
        elif step % self.every_steps == 0 or step >= self.total_steps:
            print(line, file=self.file, flush=True)
        return line

    def message(self, text: str) -> None:
        """A one-off line (e.g. "resumed from step 40") above the live bar, or as a plain line."""
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.file, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
