"""The trainer's Prometheus endpoint: what a scrape returns as steps finish (no launch; the 2-rank
scrape during a real run is in tests/train/test_train.py::test_quickstart_reward_rises_within_five_minutes)."""
import io
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from mrl.tracking.config import TrackingConfig
from mrl.tracking.prometheus import PrometheusExporter, stage_timings
from mrl.tracking.tracker import Tracker


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_stage_timings_are_the_time_keys_that_are_durations():
    metrics = {"time/rollout": 1.5, "time/actor_update": 0.5, "time/step": 2.0, "time/rollout_share": 0.75,
               "time/train_started_at": 1.7e9, "reward/mean": 0.3}
    assert stage_timings(metrics) == {"rollout": 1.5, "actor_update": 0.5}


def test_a_scrape_shows_the_step_every_metric_stage_histograms_and_a_heartbeat():
    ex = PrometheusExporter(0, "127.0.0.1", total_steps=5)
    try:
        assert ex.url == f"http://127.0.0.1:{ex.port}/metrics" and ex.port > 0
        before = scrape(ex.url)
        assert before[("mrl_step", ())] == 0 and before[("mrl_total_steps", ())] == 5
        ex.stage("rollout")
        mid = scrape(ex.url)
        assert mid[("mrl_stage", (("stage", "rollout"),))] == 1
        ex.stage("actor_update")
        ex.step_done(1, {"reward/mean": 0.25, "time/rollout": 0.3, "time/weight_sync": 0.02, "time/step": 0.4,
                         "rollout/kl_k3": 1e-4, "rollout/version_lag_max": 1.0, "note": "not a number"})
        one = scrape(ex.url)
        ex.step_done(1, {"time/checkpoint": 0.7})   # a later record of step 1: not a new step
        ex.step_done(2, {"reward/mean": 0.5, "time/rollout": 30.0, "time/step": 31.0})
        two = scrape(ex.url)
    finally:
        ex.close()
        ex.close()   # twice is fine
    assert one[("mrl_stage", (("stage", "rollout"),))] == 0 and one[("mrl_stage", (("stage", "actor_update"),))] == 1
    assert one[("mrl_step", ())] == 1 and two[("mrl_step", ())] == 2
    assert two[("mrl_steps_completed_total", ())] == 2
    assert one[("mrl_metric", (("key", "reward/mean"),))] == 0.25 and two[("mrl_reward_mean", ())] == 0.5
    assert two[("mrl_metric", (("key", "time/checkpoint"),))] == 0.7
    assert ("mrl_metric", (("key", "note"),)) not in two
    assert one[("mrl_mismatch_kl", ())] == 1e-4 and one[("mrl_version_lag_max", ())] == 1.0
    assert one[("mrl_weight_sync_seconds", ())] == 0.02 and one[("mrl_step_seconds", ())] == 0.4
    # the histogram: one observation per step, 0.3 s under the 0.5 s bucket, 30 s above it
    rollout = (("stage", "rollout"),)
    assert two[("mrl_stage_seconds_count", rollout)] == 2 and two[("mrl_stage_seconds_sum", rollout)] == 30.3
    assert two[("mrl_stage_seconds_bucket", (("le", "0.5"), ("stage", "rollout")))] == 1
    assert two[("mrl_stage_seconds_bucket", (("le", "+Inf"), ("stage", "rollout")))] == 2
    assert ("mrl_stage_seconds_count", (("stage", "step"),)) not in two
    assert two[("mrl_last_step_timestamp_seconds", ())] >= one[("mrl_last_step_timestamp_seconds", ())] > 1.7e9
    assert two[("mrl_heartbeat_timestamp_seconds", ())] >= before[("mrl_heartbeat_timestamp_seconds", ())]


def test_the_tracker_serves_on_rank_zero_says_where_and_stops_at_finish(tmp_path):
    cfg = TrackingConfig(backends=(), prometheus_port=0, prometheus_address="127.0.0.1")
    assert Tracker(cfg, run_dir=tmp_path, total_steps=2, rank=1).prometheus is None
    stream = io.StringIO()
    tracker = Tracker(cfg, run_dir=tmp_path, total_steps=2, rank=0, stream=stream)
    url = tracker.prometheus.url
    assert f"metrics: {url} (Prometheus)" in stream.getvalue()
    tracker.stage("rollout")
    tracker.log_metrics({"reward/mean": 0.5, "time/rollout": 0.1}, step=1)
    got = scrape(url)
    assert got[("mrl_step", ())] == 1 and got[("mrl_reward_mean", ())] == 0.5
    tracker.finish()
    try:
        urllib.request.urlopen(url, timeout=2)
        raise AssertionError("still serving after finish")
    except OSError:
        pass


def test_the_grafana_dashboard_queries_only_series_the_exporter_serves():
    import json
    import re
    from pathlib import Path

    dash = json.loads((Path(__file__).resolve().parents[2] / "docs/grafana_dashboard.json").read_text())
    ex = PrometheusExporter(0, "127.0.0.1")
    try:
        ex.stage("rollout")
        ex.step_done(1, {"reward/mean": 1.0, "time/rollout": 0.1})
        served = {s.name for fam in ex.registry.collect() for s in fam.samples}
    finally:
        ex.close()
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    used = {name for e in exprs for name in re.findall(r"\bmrl_[a-z_]+", e)}
    assert used and used <= served, used - served
