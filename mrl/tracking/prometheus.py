"""The trainer's live `/metrics` endpoint for Prometheus (`tracking.prometheus_port`), rank 0 only.

A cluster team scrapes it to put a run on a Grafana board (docs/grafana_dashboard.json) and to
alert on a stalled step (`time() - mrl_heartbeat_timestamp_seconds`). What it serves:

- `mrl_step`, `mrl_total_steps`, `mrl_steps_completed_total`: where the run is;
- `mrl_metric{key="reward/mean"}`: every numeric per-step metric the run logs, last value;
- `mrl_stage_seconds{stage="rollout"}` (histogram): each step's stage timings (`time/<stage>`);
- `mrl_stage{stage=...}`: 1 for the stage the step is in now, 0 for the others;
- headline gauges under stable names: `mrl_step_seconds`, `mrl_reward_mean`,
  `mrl_version_lag_mean`/`_max` (staleness), `mrl_weight_sync_seconds`, `mrl_mismatch_kl`;
- `mrl_heartbeat_timestamp_seconds`, `mrl_last_step_timestamp_seconds`: unix times of the last
  stage change or step, and of the last finished step.

The exporter has its own registry (not prometheus_client's global one), so two in one process
(tests) do not collide, and serves it from a daemon thread that `close()` shuts down.
"""
from __future__ import annotations

import math
import time
from typing import Mapping

from mrl.tracking.names import numbers

# Headline gauges: (gauge name, help, the per-step metric it shows).
HEADLINE: tuple[tuple[str, str, str], ...] = (
    ("mrl_step_seconds", "wall time of the last step", "time/step"),
    ("mrl_reward_mean", "mean training reward of the last step", "reward/mean"),
    ("mrl_val_reward_mean", "mean validation reward of the last validation", "val/reward_mean"),
    ("mrl_version_lag_mean", "policy versions the last step's responses lag the trained policy (mean)",
     "rollout/version_lag_mean"),
    ("mrl_version_lag_max", "policy versions the last step's responses lag the trained policy (max)",
     "rollout/version_lag_max"),
    ("mrl_weight_sync_seconds", "time of the last weight sync to the rollout engine", "time/weight_sync"),
    ("mrl_mismatch_kl", "train/inference mismatch KL (k3) of the last step's tokens", "rollout/kl_k3"),
)

# Stage timing buckets (seconds): a CPU demo's stages take ~0.01-1 s, a 70B step's minutes.
STAGE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, math.inf)


def stage_timings(metrics: Mapping[str, float]) -> dict[str, float]:
    """The stage durations among a step's metrics: `time/<stage>` in seconds, without the step's
    total, the rollout's share, the durations `mrl.tracking.timeline` derives and any wall-clock
    `*_at` timestamp."""
    from mrl.tracking.timeline import DERIVED

    out = {}
    for key, value in metrics.items():
        if not key.startswith("time/"):
            continue
        stage = key[len("time/"):]
        if stage in ("step", "rollout_share") + DERIVED or stage.endswith("_at") or "/" in stage:
            continue
        out[stage] = float(value)
    return out


class PrometheusExporter:
    """Serves the run's metrics on `http://address:port/metrics` until `close()`."""

    def __init__(self, port: int, address: str = "0.0.0.0", *, total_steps: int = 0, start_step: int = 0):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

        self.registry = r = CollectorRegistry()
        self.step = Gauge("mrl_step", "the last finished step", registry=r)
        self.total_steps = Gauge("mrl_total_steps", "steps the run trains (trainer.total_steps)", registry=r)
        self.steps_completed = Counter("mrl_steps_completed", "steps finished by this process", registry=r)
        self.metric = Gauge("mrl_metric", "a per-step metric of the run, last value", ["key"], registry=r)
        self.stage_seconds = Histogram("mrl_stage_seconds", "time of each stage of a step", ["stage"],
                                       buckets=STAGE_BUCKETS, registry=r)
        self.stage_now = Gauge("mrl_stage", "1 for the stage the step is in now", ["stage"], registry=r)
        self.heartbeat = Gauge("mrl_heartbeat_timestamp_seconds", "unix time of the last stage change or step",
                               registry=r)
        self.last_step_at = Gauge("mrl_last_step_timestamp_seconds", "unix time the last step finished", registry=r)
        self.headline = {key: Gauge(name, help, registry=r) for name, help, key in HEADLINE}
        self._stage: str | None = None
        self._last_step = start_step
        self.total_steps.set(total_steps)
        self.step.set(start_step)
        self.heartbeat.set(time.time())
        self.server, self._thread = start_http_server(port, addr=address, registry=r)
        self.port = self.server.server_port   # the bound port (port 0: one the OS picked)
        self.address = address

    @property
    def url(self) -> str:
        host = "localhost" if self.address in ("0.0.0.0", "::", "") else self.address
        return f"http://{host}:{self.port}/metrics"

    def stage(self, name: str) -> None:
        """The step entered stage `name`."""
        if self._stage is not None:
            self.stage_now.labels(stage=self._stage).set(0)
        self.stage_now.labels(stage=name).set(1)
        self._stage = name
        self.heartbeat.set(time.time())

    def step_done(self, step: int, metrics: Mapping[str, float]) -> None:
        """`step` finished with `metrics` (numbers; others are skipped). A later call for the same
        step (e.g. the checkpoint's time) updates its metrics without counting the step again."""
        now = time.time()
        values = numbers(metrics)
        for key, value in values.items():
            self.metric.labels(key=key).set(value)
            if key in self.headline:
                self.headline[key].set(value)
        for stage, seconds in stage_timings(values).items():
            self.stage_seconds.labels(stage=stage).observe(seconds)
        if step > self._last_step:   # a new step (not a later record of one already counted)
            self.steps_completed.inc()
            self.last_step_at.set(now)
            self._last_step = step
            self.step.set(step)
        self.heartbeat.set(now)

    def close(self) -> None:
        """Stop serving (safe to call twice)."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
