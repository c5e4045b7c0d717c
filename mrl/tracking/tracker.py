"""The trainer's one handle on tracking: console progress, MLflow and TensorBoard, rank 0 only.

    tracker = Tracker.from_spec(spec, total_steps=..., resume_run_id=ckpt.get("mlflow_run_id"))
    tracker.log_spec(spec)                     # params (dotted keys), spec.toml artifact
    tracker.stage("rollout")                   # console only
    tracker.log_metrics({"reward/mean": ...}, step)
    tracker.finish()                           # or finish("FAILED")

Save `tracker.run_id` in the checkpoint; passing it back as `resume_run_id` re-attaches to the
same MLflow run, so a resumed job continues one run. `origin` (a `checkpoint.load_from` start)
makes a new run tagged with the checkpoint it started from. On every other rank all methods do
nothing.

Tracking never kills training: keys MLflow rejects are renamed (`mrl.tracking.names`), and every
MLflow write goes through a `WriteGuard` (`mrl.tracking.journal`): retried with backoff, then
dropped with a counted warning into `<run dir>/tracking_dropped.jsonl` for `mrl track replay`.
The count is the metric `tracking/dropped_writes` of the steps after a drop. TensorBoard, wandb
and Prometheus go through `_side`: a backend that fails at start (a port in use, a read-only
directory) or mid-run is turned off with one line, counted in `tracking/failed_backends`, and
the others go on; a start interrupted after the MLflow run began ends that run FAILED.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import IO, Any, Mapping

from mrl.errors import UserError
from mrl.schema.dump import to_toml
from mrl.tracking.config import TrackingConfig
from mrl.tracking.console import ConsoleProgress
from mrl.tracking.journal import WriteGuard
from mrl.tracking.mlflow_ui import charts_address, run_address, ui_base, ui_command
from mrl.tracking.names import NameMap, numbers
from mrl.tracking.mlflow_run import MlflowRun, default_tracking_uri, ensure_store_dir, source_tags
from mrl.tracking.params import spec_params
from mrl.tracking.startup import RunSummary

log = logging.getLogger(__name__)


def run_dir_of(spec: Any) -> Path:
    """`<job.output_dir>/<job.name>`: where a job's checkpoints and default MLflow store live."""
    return Path(spec.job.output_dir) / spec.job.name


class Tracker:
    """Console progress and/or MLflow as `cfg.backends` says; a no-op on ranks other than 0."""

    def __init__(self, cfg: TrackingConfig, *, run_dir: str | os.PathLike, total_steps: int, rank: int | None = None,
                 resume_run_id: str | None = None, start_step: int = 0, stream: IO[str] | None = None,
                 force_terminal: bool | None = None, log_every_steps: int = 1,
                 origin: Mapping[str, str] | None = None):
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self._stream = stream
        self.console: ConsoleProgress | None = None
        self.mlflow: MlflowRun | None = None
        self.tensorboard = None   # torch.utils.tensorboard.SummaryWriter
        self.prometheus = None    # mrl.tracking.prometheus.PrometheusExporter
        self.wandb = None         # mrl.tracking.wandb_run.WandbRun
        self.summary = RunSummary()   # best and last rewards, for the closing summary
        self.failed_backends: list[str] = []   # backends turned off after a failure (`_side`)
        self._run_id: str | None = None
        self._target: dict[str, Any] = {}   # where MLflow writes go (journal records name it)
        self._charted: set[str] = set()     # metric keys the saved chart layout lists
        self.ui_addresses: list[str] = []   # "charts: URL", "run: URL" (`mrl.tracking.mlflow_ui`)
        self.guard = WriteGuard(run_dir, retry_s=cfg.retry_s, say=self.message)
        self.names = NameMap(self.message)   # MLflow-legal keys, each renamed key said once
        if self.rank != 0:
            return
        if "mlflow" in cfg.backends:
            uri = cfg.tracking_uri or default_tracking_uri(run_dir)
            ensure_store_dir(uri)
            from mrl.tracking.environment import environment_tags, mrl_source_dir

            # the environment of this start (a resumed run records the one it resumed on)
            tags = self.names.keys({**source_tags(mrl_source_dir()), **environment_tags(), **cfg.tags, **(origin or {})})
            name = cfg.run_name or Path(run_dir).name
            self._target = {"tracking_uri": uri, "experiment": cfg.experiment, "run_name": name, "run_id": resume_run_id}

            def start():
                try:
                    self.mlflow = MlflowRun(uri, cfg.experiment, name, run_id=resume_run_id, tags=tags, names=self.names)
                except UserError as e:   # the checkpoint's run is not in this store (moved, deleted)
                    self.message(f"tracking: {e}; this run's metrics go to a new MLflow run")
                    self.mlflow = MlflowRun(uri, cfg.experiment, name, tags={**tags, "mrl.missing_run_id": resume_run_id},
                                            names=self.names)

            if not self._write("the start of the MLflow run", start, "start", values=tags):
                self.message("tracking: MLflow is unreachable; this run's metrics go to "
                             f"{self.guard.journal} (replay them with `mrl track replay {run_dir}`)")
            if self.mlflow is not None:
                self._run_id = self._target["run_id"] = self.mlflow.run_id
                if resume_run_id is not None and self.mlflow.run_id == resume_run_id:
                    self._write("the resume tag", lambda: self.mlflow.set_tags({"mrl.resumed_at_step": str(start_step)}),
                                "tags", values={"mrl.resumed_at_step": str(start_step)})
                    # steps logged after the checkpoint are re-run
                    self._write("the removal of re-run steps", lambda: self.mlflow.forget_steps_after(start_step),
                                "forget_after", step=start_step)
                self._write("the end of stale runs", self.mlflow.end_stale_runs, "none")
                self._write("the chart layout", lambda: self.mlflow.save_chart_view(()), "none")
                base = ui_base(uri)
                if base is not None:
                    self.ui_addresses = [f"charts: {charts_address(base, self.mlflow.experiment_id)}",
                                         f"run: {run_address(base, self.mlflow.experiment_id, self.mlflow.run_id)}"]
        try:
            self._start_side_backends(cfg, run_dir, total_steps, start_step)
        except BaseException:   # e.g. KeyboardInterrupt mid-start: the MLflow run must not stay RUNNING
            self.finish("FAILED")
            raise
        if "console" in cfg.backends:
            self.console = ConsoleProgress(total_steps, start_step=start_step, file=stream,
                                           force_terminal=force_terminal, every_steps=log_every_steps)
        for line in self.start_lines(run_dir):
            self.message(line)

    def _start_side_backends(self, cfg: TrackingConfig, run_dir, total_steps: int, start_step: int) -> None:
        """TensorBoard, wandb and Prometheus, each started through `_side`: one that fails to start
        is left off with one line, and the run goes on."""
        if "tensorboard" in cfg.backends:
            def tensorboard():
                from torch.utils.tensorboard import SummaryWriter

                # a resumed run re-runs the steps after its checkpoint: drop their old events
                return SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"),
                                     purge_step=start_step + 1 if start_step else None)

            self.tensorboard = self._side("tensorboard", tensorboard)
        if "wandb" in cfg.backends:
            def wandb():
                from mrl.tracking.wandb_run import WandbRun

                return WandbRun(run_dir, project=cfg.experiment, name=cfg.run_name or Path(run_dir).name,
                                resume=start_step > 0, tags=cfg.tags)

            self.wandb = self._side("wandb", wandb)
        if cfg.prometheus_port is not None:
            def prometheus():
                from mrl.tracking.prometheus import PrometheusExporter

                return PrometheusExporter(cfg.prometheus_port, cfg.prometheus_address, total_steps=total_steps,
                                          start_step=start_step)

            self.prometheus = self._side("prometheus", prometheus)

    def _side(self, backend: str, fn):
        """`fn()` for a tracking backend other than MLflow (whose writes the `WriteGuard` keeps);
        when it raises, the backend is turned off for the rest of the run with one line, counted in
        `tracking/failed_backends`, and None is returned: a tracking failure never stops training."""
        try:
            return fn()
        except Exception as e:   # noqa: BLE001 - any backend failure, reported in one line
            why = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            self.failed_backends.append(backend)
            failed = getattr(self, backend, None)
            setattr(self, backend, None)
            if failed is not None:
                try:
                    failed.finish("FAILED") if backend == "wandb" else failed.close()
                except Exception:   # noqa: BLE001 - it failed already; closing it is best effort
                    pass
            self.message(f"tracking: {backend} failed ({type(e).__name__}{': ' + why if why else ''}); it is off "
                         "for the rest of this run, the other backends and training go on")
            return None

    @classmethod
    def from_spec(cls, spec: Any, *, total_steps: int, **kw) -> "Tracker":
        """A tracker for a resolved job spec, with the run directory `<job.output_dir>/<job.name>`."""
        tracker = cls(spec.tracking, run_dir=run_dir_of(spec), total_steps=total_steps,
                      log_every_steps=spec.trainer.log_every_steps, **kw)
        if spec.job.description:   # the UI's run description
            tracker.set_tags({"mlflow.note.content": spec.job.description})
        if kw.get("origin"):   # a new run from another run's checkpoint: its own spec params
            tracker.log_spec(spec)
        return tracker

    def _write(self, what: str, fn, op: str, **record) -> bool:
        """An MLflow write `fn` through the guard, kept as the journal record `{op, target, **record}`
        when dropped (`op` "none": nothing to keep). With no MLflow run (its start was dropped)
        everything but the start goes straight to the journal. True when it was written."""
        if not self._target:
            return True
        full = {"op": op, **self._target, **record} if op != "none" else None
        if self.mlflow is None and op != "start":
            return self.guard.drop(what, full)
        return self.guard.write(what, fn, full)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        tags = {self.names.name(k): str(v) for k, v in tags.items()}
        self._write("tags", lambda: self.mlflow.set_tags(tags), "tags", values=tags)

    def start_lines(self, run_dir) -> list[str]:
        """Where this run's files are, the command that serves its metrics and the addresses of its
        charts (the experiment's runs with the reward first, and the run's own page)."""
        lines = [f"run directory: {Path(run_dir).resolve()}"]
        if self.mlflow is not None:
            uri = self.mlflow.tracking_uri
            lines.append(f"metrics: {ui_command(uri) or 'MLflow at ' + uri}   (run {self.mlflow.run_id})")
            lines += self.ui_addresses
        if self.tensorboard is not None:
            lines.append(f"metrics: tensorboard --logdir {Path(self.tensorboard.log_dir).resolve()}")
        if self.wandb is not None:
            lines.append(f"metrics: wandb run {self.wandb.run_id} ({self.wandb.mode}) in {self.wandb.location}"
                         + ("   (upload: wandb sync <that dir>)" if self.wandb.mode == "offline" else ""))
        if self.prometheus is not None:
            lines.append(f"metrics: {self.prometheus.url} (Prometheus)")
        return lines

    @property
    def run_id(self) -> str | None:
        """The MLflow run id to store in checkpoints (None without MLflow or off rank 0)."""
        return self._run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        if self.wandb is not None:
            self._side("wandb", lambda: self.wandb.log_params(params))
        self._mlflow_params(params)

    def _mlflow_params(self, params: Mapping[str, Any]) -> None:
        params = {self.names.name(k): str(v) for k, v in params.items()}
        self._write("params", lambda: self.mlflow.log_params(params), "params", values=params)

    def log_spec(self, spec: Any) -> None:
        """The resolved spec as dotted-key params and as the `spec.toml` artifact (wandb: its config)."""
        text = to_toml(spec)
        if self.wandb is not None:
            self._side("wandb", lambda: self.wandb.log_config(text))
        self._mlflow_params(spec_params(spec))
        self._write("the spec.toml artifact", lambda: self.mlflow.log_text(text, "spec.toml"), "text", text=text,
                    artifact="spec.toml")

    def log_resumed_spec(self, spec: Any, start_step: int) -> None:
        """A resumed run's spec (`mrl.tracking.resume_spec`): `spec.toml` says what runs now, the
        earlier one is kept, changed params are listed in a tag."""
        from mrl.tracking.resume_spec import record_resumed_spec

        text = to_toml(spec)
        if self.wandb is not None:
            self._side("wandb", lambda: self.wandb.log_config(text))
        self._mlflow_params(spec_params(spec))
        self._write("the resumed spec.toml", lambda: record_resumed_spec(self.mlflow, text, start_step), "text",
                    text=text, artifact="spec.toml")

    def stage(self, name: str) -> None:
        if self.prometheus is not None:
            self._side("prometheus", lambda: self.prometheus.stage(name))
        if self.console is not None:
            self.console.stage(name)

    def log_metrics(self, metrics: Mapping[str, float], step: int, *, console: bool = True) -> None:
        """Every metric of `step` to MLflow, and the step line/bar to the console (`console=False`:
        MLflow only, for what a step measures after its line, e.g. the checkpoint's time)."""
        if self.rank == 0 and self.guard.dropped_writes:
            metrics = {**metrics, "tracking/dropped_writes": float(self.guard.dropped_writes)}
        if self.failed_backends:
            metrics = {**metrics, "tracking/failed_backends": float(len(self.failed_backends))}
        values = self.names.keys(numbers(metrics)) if self._target else {}
        self._write(f"metrics of step {step}", lambda: self.mlflow.log_metrics(values, step), "metrics", step=step,
                    values=values, time_ms=int(time.time() * 1000))
        if self.mlflow is not None and not set(values) <= self._charted:   # a key the layout does not list yet
            self._charted |= set(values)
            keys = sorted(self._charted)
            self._write("the chart layout", lambda: self.mlflow.save_chart_view(keys), "none")
        if self.tensorboard is not None:
            def tensorboard():
                for name, value in numbers(metrics).items():
                    self.tensorboard.add_scalar(name, float(value), step)
                self.tensorboard.flush()

            self._side("tensorboard", tensorboard)
        self.summary.observe(step, metrics)
        if self.wandb is not None:
            self._side("wandb", lambda: self.wandb.log_metrics(metrics, step))
        if self.prometheus is not None:
            self._side("prometheus", lambda: self.prometheus.step_done(step, metrics))
        if self.console is not None and console:
            self.console.step_done(step, metrics)

    def log_samples(self, split: str, columns: Mapping[str, list]) -> None:
        """Append sample generations (`mrl.tracking.samples.sample_rows`) to the run's
        `samples/<split>.json` table (wandb: a `samples/<split>` table)."""
        if self.wandb is not None:
            self._side("wandb", lambda: self.wandb.log_samples(split, columns))
        columns, artifact = {k: list(v) for k, v in columns.items()}, f"samples/{split}.json"
        self._write(f"{split} samples", lambda: self.mlflow.log_table(columns, artifact), "table", columns=columns,
                    artifact=artifact)

    def message(self, text: str) -> None:
        if self.console is not None:
            self.console.message(text)
        elif self.rank == 0:
            print(text, file=self._stream or sys.stdout, flush=True)

    def finish(self, status: str = "FINISHED") -> None:
        """End the run: "FINISHED", "FAILED" or "KILLED". Safe to call twice."""
        if self.console is not None:
            self.console.close()
            self.console = None
        if self._target:
            self._write(f"the run's end ({status})", lambda: self.mlflow.finish(status), "finish", status=status)
            self._target = {}
            self.mlflow = None
        for backend, end in (("tensorboard", lambda b: b.close()), ("wandb", lambda b: b.finish(status)),
                             ("prometheus", lambda b: b.close())):
            if getattr(self, backend) is not None:
                self._side(backend, lambda: end(getattr(self, backend)))
                setattr(self, backend, None)
