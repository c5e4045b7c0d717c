"""One MLflow run: created or re-attached, params, per-step metrics, artifacts, tags.

Uses `MlflowClient` (no fluent global state, so several runs or a test can coexist in a process).
A local sqlite store gets its artifacts next to it (`<dir>/mlartifacts`), not in the working
directory, which is MLflow's default for new experiments.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Mapping

from mrl.errors import UserError
from mrl.tracking.names import NameMap

log = logging.getLogger(__name__)

PARAMS_PER_BATCH = 100  # MLflow's log_batch limit for params
METRICS_PER_BATCH = 1000
HOST_TAG = "mrl.env.host"   # the one host tag (with the package versions of `mrl.tracking.environment`)


def default_tracking_uri(run_dir: str | os.PathLike) -> str:
    """`sqlite:///<abs run_dir>/mlflow.db` (the run directory is created)."""
    path = Path(run_dir).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path / 'mlflow.db'}"


def ensure_store_dir(uri: str) -> None:
    """Create the directory of a local sqlite store (MLflow creates the file, not its directory)."""
    store_dir = _sqlite_dir(uri)
    if store_dir is not None:
        store_dir.mkdir(parents=True, exist_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sqlite_path(uri: str) -> Path | None:
    """The database file of a local sqlite URI (`sqlite:///PATH`, or SQLite's URI form
    `sqlite:///file:PATH?mode=ro&uri=true`); None for other stores."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):]
    if path.startswith("file:"):
        path = path[len("file:"):].split("?", 1)[0]
    return Path(path)


def _sqlite_dir(uri: str) -> Path | None:
    path = _sqlite_path(uri)
    return path.parent if path is not None else None


def source_tags(cwd: str | os.PathLike | None = None) -> dict[str, str]:
    """Git commit (MLflow's standard tag) and whether the tree was dirty (the host is
    `mrl.env.host`, `mrl.tracking.environment`)."""
    tags: dict[str, str] = {}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        if commit.returncode == 0:
            tags["mlflow.source.git.commit"] = commit.stdout.strip()
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                                   capture_output=True, text=True, timeout=10)
            tags["mrl.git_dirty"] = str(bool(dirty.stdout.strip())).lower()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return tags


class MlflowRun:
    """A run in `experiment` at `tracking_uri`; `run_id` re-attaches to an existing run (resume)."""

    def __init__(self, tracking_uri: str, experiment: str, run_name: str, *, run_id: str | None = None,
                 tags: Mapping[str, str] | None = None, names: NameMap | None = None):
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.names = names or NameMap()   # keys MLflow would reject are renamed (said once)
        # its own report of a failed database write is a traceback per try: the caller says it once
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.tracking_uri = tracking_uri
        if run_id is not None:
            try:
                run = self.client.get_run(run_id)
            except MlflowException:
                raise UserError(f"cannot resume tracking: no MLflow run {run_id} at {tracking_uri}") from None
            self.client.update_run(run_id, status="RUNNING")
            self._logged_params = dict(run.data.params)
        else:
            exp = self.client.get_experiment_by_name(experiment)
            if exp is not None:
                exp_id = exp.experiment_id
            else:
                store_dir = _sqlite_dir(tracking_uri)
                location = (store_dir / "mlartifacts").resolve().as_uri() if store_dir is not None else None
                exp_id = self.client.create_experiment(experiment, artifact_location=location)
            run = self.client.create_run(exp_id, run_name=run_name)
            self._logged_params = {}
        self.run_id = run.info.run_id
        self.experiment_id = run.info.experiment_id
        from mrl.tracking.experiment import declare_training_experiment, hide_empty_default_experiment

        declare_training_experiment(self.client, self.experiment_id)   # the UI's training view, not GenAI
        hide_empty_default_experiment(self.client)
        self.run_name = run.info.run_name
        # who writes to the run now: lets a later start tell a dead run from a live one
        self.set_tags({**(tags or {}), HOST_TAG: socket.gethostname(), "mrl.pid": str(os.getpid())})

    def end_stale_runs(self) -> list[str]:
        """Mark KILLED the other runs of this experiment and run name still RUNNING whose process is
        gone (a job killed outright, before it could say so: SIGKILL, an out-of-memory kill, a lost
        node). A run whose process still lives on this host is left alone. Returns their ids."""
        name = self.run_name.replace("'", "\\'")
        runs = self.client.search_runs([self.experiment_id], f"attributes.run_name = '{name}' and "
                                                             "attributes.status = 'RUNNING'")
        ended = []
        for r in runs:
            if r.info.run_id == self.run_id:
                continue
            # runs written by earlier mrl versions name the host `mrl.host`
            host, pid = r.data.tags.get(HOST_TAG, r.data.tags.get("mrl.host")), r.data.tags.get("mrl.pid", "")
            if host == socket.gethostname() and pid.isdigit() and _alive(int(pid)):
                continue
            self.client.set_tag(r.info.run_id, "mrl.ended_by", "still RUNNING when the job started again: its process had died")
            self.client.set_terminated(r.info.run_id, status="KILLED")
            ended.append(r.info.run_id)
        if ended:
            log.warning("MLflow: marked %d run(s) of a killed earlier attempt KILLED: %s", len(ended), ", ".join(ended))
        return ended

    def forget_steps_after(self, step: int) -> int:
        """Remove this run's metric rows of steps after `step`: a resumed run logs those steps again
        (its previous process logged them, then died before the next checkpoint), and each step
        must have one row. MLflow has no API to delete metric rows, so this edits a local sqlite
        store directly; with any other store the steps are named in the tag
        `mrl.rerun_after_step` (mrl's readers keep the latest row of a step). Returns rows removed."""
        import sqlite3

        self.set_tags({"mrl.rerun_after_step": str(step)})
        store_dir = _sqlite_dir(self.tracking_uri)
        if store_dir is None:
            return 0
        with contextlib.closing(sqlite3.connect(_sqlite_path(self.tracking_uri), timeout=60)) as db, db:
            removed = db.execute("DELETE FROM metrics WHERE run_uuid = ? AND step > ?", (self.run_id, step)).rowcount
            if removed:   # latest_metrics: the newest remaining row of each key (MLflow's order)
                latest: dict[str, tuple] = {}
                for row in db.execute("SELECT key, value, timestamp, step, is_nan FROM metrics WHERE run_uuid = ?",
                                      (self.run_id,)):
                    if row[0] not in latest or (row[3], row[2], row[1]) > (latest[row[0]][3], latest[row[0]][2],
                                                                           latest[row[0]][1]):
                        latest[row[0]] = row
                db.execute("DELETE FROM latest_metrics WHERE run_uuid = ?", (self.run_id,))
                db.executemany("INSERT INTO latest_metrics (key, value, timestamp, step, is_nan, run_uuid) "
                               "VALUES (?, ?, ?, ?, ?, ?)", [(*r, self.run_id) for r in latest.values()])
        if removed:
            log.warning("MLflow: removed %d metric rows of steps after %d (logged before the resumed checkpoint's "
                        "run died; they are logged again)", removed, step)
        return removed

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in self.names.keys(tags).items()])

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log params. MLflow params are immutable: on a resumed run, keys already logged with the same
        value are skipped, and changed ones are kept as they were and listed in the `mrl.resume_changed_params` tag."""
        from mlflow.entities import Param

        params = self.names.keys(params)
        new = {k: str(v) for k, v in params.items() if k not in self._logged_params}
        changed = sorted(k for k, v in params.items() if k in self._logged_params and self._logged_params[k] != str(v))
        if changed:
            log.warning("resumed run %s: params changed since it started (kept the original values): %s",
                        self.run_id, ", ".join(changed))
            self.set_tags({"mrl.resume_changed_params": ",".join(changed)[:5000]})
        items = list(new.items())
        for i in range(0, len(items), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in items[i:i + PARAMS_PER_BATCH]])
        self._logged_params.update(new)

    def log_metrics(self, metrics: Mapping[str, float], step: int, *, timestamp_ms: int | None = None) -> None:
        """Every metric at `step`. Non-numeric values are skipped; NaN is stored as NaN."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000) if timestamp_ms is None else int(timestamp_ms)
        items = []
        for k, v in self.names.keys(metrics).items():
            try:
                value = float(v)
            except (TypeError, ValueError):
                continue
            items.append(Metric(k, value if not math.isinf(value) else math.copysign(1e308, value), now, step))
        for i in range(0, len(items), METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=items[i:i + METRICS_PER_BATCH])

    def log_table(self, columns: Mapping[str, list], artifact_file: str) -> None:
        self.client.log_table(self.run_id, data=dict(columns), artifact_file=artifact_file)

    def log_text(self, text: str, artifact_path: str) -> None:
        self.client.log_text(self.run_id, text, artifact_path)

    def save_chart_view(self, metric_keys) -> None:
        """The experiment's saved chart layout (`mrl.tracking.mlflow_ui`): reward first, then
        every group of `metric_keys` by name; it keeps the time it was first saved."""
        import json

        from mrl.tracking.mlflow_ui import VIEW_TAG, view_tag_value

        created = None
        old = self.client.get_experiment(self.experiment_id).tags.get(VIEW_TAG)
        with contextlib.suppress(ValueError, TypeError, KeyError):
            created = int(json.loads(old)["createdAt"]) if old else None
        now = int(time.time() * 1000)
        self.client.set_experiment_tag(self.experiment_id, VIEW_TAG, view_tag_value(metric_keys, now_ms=now,
                                                                                     created_ms=created))

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)
