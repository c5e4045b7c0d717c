"""The wandb backend (`tracking.backends = [..., "wandb"]`): metrics, the spec as config, sample
tables as `wandb.Table`, rank 0 only.

Offline unless told otherwise: without `WANDB_API_KEY` (and no `WANDB_MODE`) the run is written
to `<run dir>/wandb/offline-run-*/` and `wandb sync <that dir>` uploads it later, so a cluster node
without a network (or a CI box) logs the same way. Every metric is plotted against `trainer/step`
(not wandb's own step counter), so a record for an earlier step (the checkpoint's time, a
validation the rollout side finished late) is kept instead of dropped. The wandb run id is kept in
`<run dir>/wandb/mrl_run_id`, so a resumed job continues the same wandb run (in a directory of its
own: `wait_for_a_new_second`).
"""
from __future__ import annotations

import math
import os
import secrets
import time
import tomllib
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping

from mrl.tracking.names import numbers

STEP_KEY = "trainer/step"
SERVICE_ENV = "WANDB_SERVICE"   # wandb.env.SERVICE: the running service's token


def wandb_mode(environ: Mapping[str, str] = os.environ) -> str:
    """`WANDB_MODE` when set, else "online" with an API key and "offline" without one."""
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"]
    return "online" if environ.get("WANDB_API_KEY") else "offline"


def wait_for_a_new_second(root: Path, run_id: str, *, clock=time.time, sleep=time.sleep) -> float:
    """wandb names a run's directory `[offline-]run-<start second>-<run id>`: a run re-attached
    within the second its previous attempt started (a job that failed at once and was started
    again) would write over that attempt's file and lose its records. When that directory exists,
    sleep into the next second; returns the seconds slept."""
    now = clock()
    second = datetime.fromtimestamp(now).strftime("%Y%m%d_%H%M%S")
    if not any((root / f"{mode}-{second}-{run_id}").exists() for mode in ("offline-run", "run")):
        return 0.0
    pause = math.floor(now) + 1 - now + 0.01
    sleep(pause)
    return pause


class WandbRun:
    """One wandb run in `<run_dir>/wandb`; `resume=True` re-attaches to the run this directory had."""

    def __init__(self, run_dir: str | os.PathLike, *, project: str, name: str, resume: bool = False,
                 tags: Mapping[str, str] | None = None):
        import wandb

        self._wandb = wandb
        root = Path(run_dir) / "wandb"
        root.mkdir(parents=True, exist_ok=True)
        id_file = root / "mrl_run_id"
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        self.mode = wandb_mode()
        if resume:
            wait_for_a_new_second(root, run_id)
        # A wandb service inherited from a parent process (its token in WANDB_SERVICE: a launcher or a
        # test process that used wandb) would write this run, and `finish` would then return without
        # waiting for it: the run file could be read (or the parent's service exit) before it is
        # flushed. This run starts and owns its service, so `finish` waits until the file is complete.
        os.environ.pop(SERVICE_ENV, None)
        self.run = wandb.init(project=project, name=name, dir=str(Path(run_dir)), id=run_id, mode=self.mode,
                              resume="allow", tags=[f"{k}={v}"[:64] for k, v in (tags or {}).items()],
                              settings=wandb.Settings(console="off", silent=True))
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)
        self.step = 0   # the newest step logged (sample tables are logged under it)

    @property
    def run_id(self) -> str:
        return self.run.id

    @property
    def location(self) -> str:
        """Where the run's files are (offline: what `wandb sync` takes)."""
        return str(Path(self.run.dir).parent)

    def log_config(self, spec_toml: str) -> None:
        """The resolved spec (its TOML text) as the run's nested config."""
        self.run.config.update(tomllib.loads(spec_toml), allow_val_change=True)

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.run.config.update({k: str(v) for k, v in params.items()}, allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        values = numbers(metrics)
        self.run.log({**values, STEP_KEY: step})
        self.step = max(self.step, step)

    def log_samples(self, split: str, columns: Mapping[str, list]) -> None:
        """A sample table (`mrl.tracking.samples.sample_rows`) as `samples/<split>` of the newest step."""
        names = list(columns)
        table = self._wandb.Table(columns=names, data=[list(row) for row in zip(*(columns[n] for n in names))])
        self.run.log({f"samples/{split}": table, STEP_KEY: self.step})

    def finish(self, status: str = "FINISHED") -> None:
        """End the run and wait until wandb's service has written it out (`run.finish()` alone
        returns before an offline run file is flushed)."""
        code = 0 if status == "FINISHED" else 1
        self.run.finish(exit_code=code)
        self._wandb.teardown(exit_code=code)
