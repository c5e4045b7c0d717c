"""Tracking never kills training: illegal names are renamed (said once), failed writes are retried,
then dropped, counted and journaled; the journal replays; a load_from start is a new run."""
import io
import json
import threading
import time
from types import SimpleNamespace

import pytest
from mlflow.tracking import MlflowClient

from mrl.tracking.config import TrackingConfig
from mrl.tracking.journal import JOURNAL, WriteGuard, replay
from mrl.tracking.names import NameMap, is_legal_name, legal_name
from mrl.tracking.origin import tracking_start
from mrl.tracking.tracker import Tracker


@pytest.mark.parametrize("name, legal", [
    ("pass@1", "pass_at_1"), ("reward/score/mean", "reward/score/mean"), ("a//b/", "a/b"), ("/x", "x"),
    ("./a", "_/a"), ("../up", "__/up"), ("acc%", "acc_pct"), ("é", "_"), ("", "_"), ("a:b", "a_b"),
])
def test_legal_names(name, legal):
    assert legal_name(name) == legal and is_legal_name(legal)


def test_each_renamed_key_is_said_once_and_collisions_stay_apart():
    said = []
    names = NameMap(said.append)
    assert names.keys({"pass@1": 1, "ok": 2}) == {"pass_at_1": 1, "ok": 2}
    assert names.name("pass@1") == "pass_at_1" and names.name("pass#1") == "pass_n1"
    assert names.name("pass_at_1") == "pass_at_1"
    assert len(said) == 2 and "'pass@1'" in said[0] and "'pass_at_1'" in said[0]


def test_a_write_is_retried_then_dropped_counted_and_journaled(tmp_path):
    said, slept = [], []
    guard = WriteGuard(tmp_path, retry_s=3.0, first_delay_s=0.5, say=said.append, sleep=slept.append)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("database is locked")

    assert guard.write("metrics of step 1", flaky, {"op": "metrics"}) and guard.retried_writes == 1
    assert slept == [0.5, 1.0] and guard.dropped_writes == 0 and not (tmp_path / JOURNAL).exists()

    def broken():
        raise RuntimeError("attempt to write a readonly database\nmore")

    start = time.monotonic()
    assert not guard.write("metrics of step 2", broken, {"op": "metrics", "step": 2})
    assert guard.dropped_writes == 1 and "attempt to write a readonly database" in said[-1]
    assert "1 write(s) dropped so far" in said[-1] and "mrl track replay" in said[-1]
    slept.clear()
    assert not guard.write("metrics of step 3", broken, {"op": "metrics", "step": 3})
    assert slept == [] and guard.dropped_writes == 2   # a broken store: tried once, no backoff
    assert not guard.write("metrics of step 4", broken, {"op": "metrics", "step": 4})
    assert len([s for s in said if "dropped so far" in s]) == 2   # the 1st and 2nd drop said, the 3rd counted
    assert [json.loads(x)["step"] for x in (tmp_path / JOURNAL).read_text().splitlines()] == [2, 3, 4]
    assert guard.write("metrics of step 5", lambda: None, {"op": "metrics"}) and "again" in said[-1]
    assert time.monotonic() - start < 2


def read_only(uri: str) -> str:
    return f"sqlite:///file:{uri[len('sqlite:///'):]}?mode=ro&uri=true"


def test_a_read_only_store_and_an_illegal_name_leave_the_run_going_and_replay_later(tmp_path):
    good = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = Tracker(TrackingConfig(backends=("mlflow",), tracking_uri=good), run_dir=tmp_path / "r", total_steps=2,
                    rank=0, stream=io.StringIO())
    run_id = first.run_id
    first.finish("KILLED")
    stream = io.StringIO()
    cfg = TrackingConfig(backends=("mlflow",), tracking_uri=read_only(good), tags={"team@x": "rl"}, retry_s=0.5)
    t = Tracker(cfg, run_dir=tmp_path / "r", total_steps=2, rank=0, stream=stream, resume_run_id=run_id, start_step=0)
    for step in (1, 2):
        t.log_metrics({"reward/pass@1": 0.5 * step, "loss": 1.0}, step)   # never raises
    t.finish()
    out = stream.getvalue()
    assert "'reward/pass@1'" in out and "'reward/pass_at_1'" in out and "readonly database" in out
    assert t.guard.dropped_writes >= 3
    client = MlflowClient(good)
    assert client.get_metric_history(run_id, "loss") == []
    report = replay(tmp_path / "r", tracking_uri=good)
    assert report.failed == 0 and report.written >= 3 and not (tmp_path / "r" / JOURNAL).exists()
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "reward/pass_at_1")] == [(1, 0.5), (2, 1.0)]
    assert client.get_metric_history(run_id, "tracking/dropped_writes")[-1].value >= 2
    run = client.get_run(run_id)
    assert run.data.tags["team_at_x"] == "rl" and run.info.status == "FINISHED"


def test_a_locked_store_is_waited_for(tmp_path):
    import sqlite3

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    t = Tracker(TrackingConfig(backends=("mlflow",), tracking_uri=uri), run_dir=tmp_path, total_steps=1, rank=0,
                stream=io.StringIO())
    db = sqlite3.connect(tmp_path / "mlflow.db", isolation_level=None, check_same_thread=False)
    db.execute("BEGIN EXCLUSIVE")
    threading.Timer(2.0, lambda: db.execute("COMMIT")).start()
    t.log_metrics({"m": 1.0}, 1)     # the store is locked for 2 s: the write waits and lands
    t.finish()
    assert [m.value for m in MlflowClient(uri).get_metric_history(t.run_id, "m")] == [1.0]
    assert t.guard.dropped_writes == 0


def test_load_from_another_run_is_a_new_run_that_says_where_it_came_from(tmp_path):
    spec = SimpleNamespace(checkpoint=SimpleNamespace(load_from=str(tmp_path / "other/checkpoints/actor"),
                                                      dir=str(tmp_path / "me/checkpoints")))
    run_id, origin = tracking_start(spec, 7, {"mlflow_run_id": "abc"})
    assert run_id is None and origin == {"mrl.loaded_from": str(tmp_path / "other/checkpoints/actor"),
                                         "mrl.loaded_from_step": "7", "mrl.loaded_from_run_id": "abc"}
    spec.checkpoint.load_from = str(tmp_path / "me/checkpoints/actor/step_00000007")
    assert tracking_start(spec, 7, {"mlflow_run_id": "abc"}) == ("abc", {})   # its own checkpoint: resume
    spec.checkpoint.load_from = None
    assert tracking_start(spec, 3, {"mlflow_run_id": "abc"}) == ("abc", {})
    assert tracking_start(spec, 0, {}) == (None, {})
