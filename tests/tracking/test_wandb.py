"""The wandb backend, offline: metrics, the spec as config and sample tables, read back from the
run file (the quickstart's offline wandb run is checked in tests/train/test_train.py)."""
import io
import json

from mrl.config.loader import load
from mrl.tracking.tracker import Tracker, run_dir_of
from mrl.tracking.wandb_run import wandb_mode
from tests.tracking.wandb_records import records


def test_offline_without_an_api_key_unless_wandb_mode_says_otherwise():
    assert wandb_mode({}) == "offline" and wandb_mode({"WANDB_API_KEY": ""}) == "offline"
    assert wandb_mode({"WANDB_API_KEY": "k"}) == "online"
    assert wandb_mode({"WANDB_API_KEY": "k", "WANDB_MODE": "offline"}) == "offline"
    assert wandb_mode({"WANDB_MODE": "disabled"}) == "disabled"


def test_an_offline_run_holds_metrics_config_and_samples_and_a_resume_continues_it(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    # a parent process's wandb service: not used (finish must wait for a service the run owns)
    monkeypatch.setenv("WANDB_SERVICE", "not-a-service-token")
    spec, _ = load("jobs/quickstart_cpu.toml", [f"job.output_dir={tmp_path}", 'tracking.backends=["wandb"]',
                                                "tracking.tags={team = \"rl\"}"])
    stream = io.StringIO()
    tracker = Tracker.from_spec(spec, total_steps=3, rank=0, stream=stream)
    run_id = tracker.wandb.run_id
    assert tracker.wandb.mode == "offline" and f"metrics: wandb run {run_id} (offline)" in stream.getvalue()
    tracker.log_spec(spec)
    tracker.log_metrics({"reward/mean": 0.25, "time/rollout": 0.5, "note": "skipped"}, step=1)
    tracker.log_metrics({"reward/mean": 0.5}, step=2)
    tracker.log_samples("train", {"step": [2, 2], "prompt": ["1+1", "2+2"], "response": ["2", "5"],
                                  "score": [1.0, 0.0]})
    tracker.log_metrics({"time/checkpoint": 0.1}, step=1)   # an earlier step: kept, plotted at step 1
    tracker.finish()
    (run_file,) = (run_dir_of(spec) / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    wb = records(run_file)
    assert wb["run"].project == "mrl" and wb["run"].display_name == "quickstart-cpu"
    assert list(wb["run"].tags) == ["team=rl"]
    rows = [{k: v for k, v in r.items() if not k.startswith("_")} for r in wb["history"]]
    scalars = [r for r in rows if not any(k.startswith("samples/") for k in r)]
    assert scalars == [{"reward/mean": 0.25, "time/rollout": 0.5, "trainer/step": 1},
                       {"reward/mean": 0.5, "trainer/step": 2}, {"time/checkpoint": 0.1, "trainer/step": 1}]
    cfg = wb["config"]
    assert cfg["trainer"]["total_steps"] == 40 and cfg["data"]["prompts_per_step"] == 8
    assert cfg["tracking"]["backends"] == ["wandb"]
    (table_file,) = run_file.parent.glob("files/media/table/samples/train_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == ["step", "prompt", "response", "score"]
    assert table["data"] == [[2, "1+1", "2", 1.0], [2, "2+2", "5", 0.0]]

    resumed = Tracker.from_spec(spec, total_steps=3, rank=0, stream=stream, start_step=2)
    assert resumed.wandb.run_id == run_id
    resumed.log_metrics({"reward/mean": 0.75}, step=3)
    resumed.finish()
    files = sorted((run_dir_of(spec) / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    steps = [r["trainer/step"] for f in files for r in records(f)["history"] if "reward/mean" in r]
    assert sorted(steps) == [1, 2, 3]


def test_a_resume_in_the_same_second_waits_for_a_directory_of_its_own(tmp_path):
    """wandb names a run directory by its start second and id: the resumed attempt must not
    reuse (and overwrite) the directory of the attempt before it."""
    from datetime import datetime

    from mrl.tracking.wandb_run import wait_for_a_new_second

    now = 1_700_000_000.25
    slept = []
    assert wait_for_a_new_second(tmp_path, "abc", clock=lambda: now, sleep=slept.append) == 0.0 and not slept
    second = datetime.fromtimestamp(now).strftime("%Y%m%d_%H%M%S")
    (tmp_path / f"offline-run-{second}-abc").mkdir()
    pause = wait_for_a_new_second(tmp_path, "abc", clock=lambda: now, sleep=slept.append)
    assert slept == [pause] and 0.75 < pause < 0.8   # into the next second
    assert wait_for_a_new_second(tmp_path, "other", clock=lambda: now, sleep=slept.append) == 0.0
