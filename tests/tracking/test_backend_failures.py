"""A tracking backend that fails at start or mid-run is turned off with one line and counted;
training, the other backends and the MLflow run go on, and the run never stays RUNNING; a journal
replays into a fresh store; a reward's extra metric keys are capped."""
from __future__ import annotations

import io
import json
import socket

import pytest
from mlflow.tracking import MlflowClient

from mrl.reward.compose import MAX_METRIC_KEYS, Rewarder, RewardSample
from mrl.reward.config import RewardConfig
from mrl.tracking import wandb_run
from mrl.tracking.config import TrackingConfig
from mrl.tracking.journal import JOURNAL, replay
from mrl.tracking.tracker import Tracker


def tracker(tmp_path, stream, **cfg):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return Tracker(TrackingConfig(tracking_uri=uri, **cfg), run_dir=tmp_path / "r", total_steps=3, rank=0,
                   stream=stream), MlflowClient(uri)


def test_a_prometheus_port_in_use_leaves_prometheus_off_and_the_run_going(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = io.StringIO()
        t, client = tracker(tmp_path, out, backends=("mlflow",), prometheus_port=port, prometheus_address="127.0.0.1")
        assert t.prometheus is None and t.failed_backends == ["prometheus"]
        t.stage("rollout")
        t.log_metrics({"loss": 1.0}, 1)
        t.finish()
    lines = [line for line in out.getvalue().splitlines() if "prometheus failed" in line]
    assert len(lines) == 1 and "off for the rest of this run" in lines[0], out.getvalue()
    run = client.get_run(t.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["tracking/failed_backends"] == 1.0 and run.data.metrics["loss"] == 1.0


def test_wandb_that_cannot_write_its_directory_is_off_from_the_start(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "wandb").write_text("not a directory")   # where wandb must write
    out = io.StringIO()
    t, client = tracker(tmp_path, out, backends=("mlflow", "wandb"))
    assert t.wandb is None and t.failed_backends == ["wandb"]
    t.log_metrics({"loss": 2.0}, 1)
    run_id = t.run_id
    t.finish()
    assert client.get_run(run_id).info.status == "FINISHED"
    assert sum("wandb failed" in line for line in out.getvalue().splitlines()) == 1


class BreaksAtStep:
    """A backend whose writes fail from step `at` on (a disk gone read-only mid-run)."""

    def __init__(self, *a, at=2, **kw):
        self.at, self.calls, self.run_id, self.mode, self.location = at, [], "x", "offline", "here"

    def log_metrics(self, metrics, step):
        if step >= self.at:
            raise OSError(30, "Read-only file system")
        self.calls.append(step)

    def log_params(self, params):
        pass

    def log_config(self, text):
        pass

    def finish(self, status):
        raise OSError(30, "Read-only file system")


def test_a_backend_failing_mid_run_is_turned_off_once_and_the_steps_go_on(tmp_path, monkeypatch):
    monkeypatch.setattr(wandb_run, "WandbRun", BreaksAtStep)
    out = io.StringIO()
    t, client = tracker(tmp_path, out, backends=("mlflow", "wandb"))
    backend = t.wandb
    run_id = t.run_id
    for step in (1, 2, 3, 4):
        t.log_metrics({"loss": float(step)}, step)   # never raises
    t.finish()
    assert backend.calls == [1] and t.failed_backends == ["wandb"]
    assert sum("wandb failed" in line for line in out.getvalue().splitlines()) == 1
    assert [m.value for m in client.get_metric_history(run_id, "loss")] == [1.0, 2.0, 3.0, 4.0]
    assert client.get_metric_history(run_id, "tracking/failed_backends")[-1].value == 1.0
    assert client.get_run(run_id).info.status == "FINISHED"


def test_an_interrupted_start_ends_the_mlflow_run_failed(tmp_path, monkeypatch):
    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(wandb_run, "WandbRun", interrupted)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(KeyboardInterrupt):
        Tracker(TrackingConfig(tracking_uri=uri, backends=("mlflow", "wandb")), run_dir=tmp_path / "r", total_steps=3,
                rank=0, stream=io.StringIO())
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("mrl").experiment_id])
    assert run.info.status == "FAILED"


def test_a_journal_replays_into_a_fresh_store(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    target = {"tracking_uri": f"sqlite:///{tmp_path / 'gone' / 'mlflow.db'}", "experiment": "mrl", "run_name": "r",
              "run_id": "0123456789abcdef0123456789abcdef"}
    records = [{"op": "params", **target, "values": {"lr": "0.1"}},
               {"op": "metrics", **target, "step": 1, "values": {"loss": 0.5}, "time_ms": 1},
               {"op": "finish", **target, "status": "FINISHED"}]
    (run_dir / JOURNAL).write_text("".join(json.dumps(r) + "\n" for r in records))
    fresh = f"sqlite:///{tmp_path / 'new' / 'store' / 'mlflow.db'}"
    report = replay(run_dir, tracking_uri=fresh)
    assert (report.written, report.failed) == (3, 0)
    client = MlflowClient(fresh)
    [run] = client.search_runs([client.get_experiment_by_name("mrl").experiment_id])
    assert run.data.tags["mrl.replayed_from_run_id"] == target["run_id"] and run.info.status == "FINISHED"
    assert run.data.metrics == {"loss": 0.5} and run.data.params == {"lr": "0.1"}


def test_a_reward_with_many_metric_keys_logs_the_first_ones_and_counts_the_rest(tmp_path, caplog):
    funcs = tmp_path / "many.py"
    funcs.write_text("def score(prompt, response, ground_truth, extra):\n"
                     "    return {'score': 1.0, **{f'k{i}': float(i) for i in range(int(response))}}\n")
    cfg = RewardConfig(function=f"{funcs}:score", workers=1)
    with Rewarder.from_config(cfg) as r:
        res = r.score([RewardSample(f"s{i}", "q", n, "", data_source="t") for i, n in enumerate(["3", "200000", "70"])])
        again = r.score([RewardSample("s9", "q", "200000", "", data_source="t")])
    keys = [k for k in res.stats if k.startswith("reward/score/k")]
    assert len(keys) == MAX_METRIC_KEYS == 64 and "reward/score/k63" in keys and "reward/score/k64" not in keys
    assert res.stats["reward/score/metrics_cut_calls"] == 2.0 and again.stats["reward/score/metrics_cut_calls"] == 1.0
    assert res.scores == [1.0, 1.0, 1.0]
    assert sum("more than 64 metric keys" in rec.getMessage() for rec in caplog.records) == 1
