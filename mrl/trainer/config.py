"""The `trainer` section: length of the run, validation and logging cadence."""
from __future__ import annotations

from typing import Optional

from mrl.config.schema import option, section


@section
class TrainerConfig:
    """Run length and cadence. `total_steps` wins over `epochs` when both are set."""

    epochs: int = option(1, ge=1, help="passes over the prompt set")
    total_steps: Optional[int] = option(None, ge=1, help="stop after this many steps")
    val_every_steps: int = option(0, ge=0, help="validate every N steps; 0 = never")
    val_before_train: bool = option(False, help="validate once before the first step")
    log_samples_every: int = option(10, ge=0, help="every N steps (and the last) MLflow gets a table of sample generations (prompt, response, score) in samples/train.json, and every validation in samples/validation.json; 0 = never")
    log_every_steps: int = option(1, ge=1, help="the console prints a progress line every N steps (and the last); MLflow records every step")
    profile_steps: tuple[int, ...] = option((), ge=1, help="steps traced with torch.profiler: <job.output_dir>/<job.name>/profile/step_<N>/rank_<r>.json (Chrome trace)")
