"""What a starting run says before its first step, and what it says at its end (rank 0).

The first line comes as soon as the command starts (before torch is imported), then one line per
start-up phase with the time the previous one took, so the 20 s (CPU demo) to minutes (a 7B
model) before the first step are not silent:

    mrl train jobs/quickstart_cpu.toml: checking the job
    spec ok (2.1s): run directory /.../runs/quickstart-cpu
    process groups (1.3s): world 2, TP 2 x PP 1 x DP 1
    prompts (0.2s): 256 train prompts
    loading actor weights 120/291 (5.0s)          (rank 0's tensors, every few seconds)
    actor (9.8s): builtin:tiny-qwen2
    rollout engine (0.4s): hf

The end: the final checkpoint, the best and last reward, the wall time, what to run next and the
addresses of the run's charts in MLflow's UI (`mrl.tracking.mlflow_ui`).
This module imports nothing heavy, so `mrl.cli` can use it first.
"""
from __future__ import annotations

import os
import shlex
import sys
import time
from typing import IO, Mapping, Optional, Sequence

REWARD_KEYS = ("reward/mean", "val/reward_mean")


def is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


class StartupLog:
    """Prints each start-up phase on rank 0 with the duration of the phase before it."""

    def __init__(self, stream: Optional[IO[str]] = None, rank_zero: Optional[bool] = None):
        self.stream = stream
        self.on = is_rank_zero() if rank_zero is None else rank_zero
        self.t0 = self._last = time.monotonic()

    def start(self) -> None:
        """Speak from now on (rank 0), timing from now: the commands that train call it first."""
        self.on = is_rank_zero()
        self.t0 = self._last = time.monotonic()

    def say(self, text: str, *, timed: bool = False, mark: bool = True) -> Optional[str]:
        """Print `text`; `timed`: with the seconds since the previous phase line, e.g. "spec ok
        (2.1s)"; `mark=False`: a line within a phase (progress), which does not end the phase."""
        now = time.monotonic()
        if timed:
            head, sep, rest = text.partition(":")
            text = f"{head} ({now - self._last:.1f}s){sep}{rest}"
        if mark:
            self._last = now
        if self.on:
            print(text, file=self.stream or sys.stdout, flush=True)
            return text
        return None


# one per process: `mrl train` / `mrl sft` start it, the training loop continues it; silent until
# started, so the weight loads of other commands (`mrl eval`, `mrl generate`: JSONL on stdout) say nothing
STARTUP = StartupLog(rank_zero=False)


class LoadProgress:
    """`progress(done, total)` for a weight import: "loading actor weights 120/291 (14.2s)" on
    rank 0, at most one line every `every_s` seconds and always the last one, so a 7B model's
    minutes of loading show their pace without flooding the console."""

    def __init__(self, what: str, *, log: Optional[StartupLog] = None, every_s: float = 5.0, clock=time.monotonic):
        self.what, self.every_s, self.clock = what, every_s, clock
        self.log = log or STARTUP
        self.t0 = clock()
        self._shown = self.t0
        self.lines: list[str] = []

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if done < total and now - self._shown < self.every_s:
            return
        self._shown = now
        line = self.log.say(f"loading {self.what} {done}/{total} ({now - self.t0:.1f}s)", mark=False)
        if line is not None:
            self.lines.append(line)


class RunSummary:
    """The best and last training and validation rewards a run logged (`observe` each step)."""

    def __init__(self):
        self.last: dict[str, tuple[int, float]] = {}
        self.best: dict[str, tuple[int, float]] = {}

    def observe(self, step: int, metrics: Mapping[str, float]) -> None:
        for key in REWARD_KEYS:
            if key not in metrics:
                continue
            value = float(metrics[key])
            if value != value:   # nan: neither best nor last
                continue
            if key not in self.last or step >= self.last[key][0]:
                self.last[key] = (step, value)
            if key not in self.best or value > self.best[key][1]:
                self.best[key] = (step, value)

    def lines(self, *, steps: int, wall_s: float, checkpoint: Optional[str], run_dir: str,
              tracking_uri: Optional[str], addresses: Sequence[str] = ()) -> list[str]:
        """The closing summary: what the run ended with, the commands to run next (paths quoted
        for the shell) and `addresses`, the lines naming where the run's charts are."""
        from mrl.tracking.mlflow_ui import ui_command

        parts = [f"done: {steps} steps in {_duration(wall_s)}"]
        for key, label in (("reward/mean", "reward"), ("val/reward_mean", "val reward")):
            if key in self.last:
                (ls, lv), (bs, bv) = self.last[key], self.best[key]
                parts.append(f"{label} last {lv:.4g} (step {ls}), best {bv:.4g} (step {bs})")
        parts.append(f"final checkpoint {checkpoint}" if checkpoint else "no checkpoint saved")
        nxt = []
        if checkpoint:
            nxt.append(f"mrl merge {shlex.quote(run_dir)} {shlex.quote(run_dir + '/hf')}")
        nxt.append(f"mrl compare {shlex.quote(run_dir)}")
        command = ui_command(tracking_uri) if tracking_uri else None
        if command:
            nxt.append(command)
        return ["; ".join(parts), "next: " + "   ".join(nxt), *addresses]


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}"


def say_summary(tracker, spec, *, steps: int, checkpoint_root) -> list[str]:
    """The closing summary of a finished training run, through `tracker` (rank 0 prints it)."""
    from pathlib import Path

    from mrl.checkpoint import store

    if tracker is None or tracker.rank != 0:
        return []
    found = store.latest(Path(checkpoint_root) / "actor")
    run_dir = Path(spec.job.output_dir) / spec.job.name
    uri = spec.tracking.tracking_uri if "mlflow" in spec.tracking.backends else None
    lines = tracker.summary.lines(steps=steps, wall_s=time.monotonic() - STARTUP.t0,
                                  checkpoint=str(found.resolve()) if found else None, run_dir=str(run_dir),
                                  tracking_uri=uri, addresses=tracker.ui_addresses)
    for line in lines:
        tracker.message(line)
    return lines
