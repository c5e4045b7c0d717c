"""Fault battery, runs that must not eat each other and tracking that must not kill training
(issue 24): two launches of one job, a stale run lock, `load_from` another run, a merge into a
checkpoint root, MLflow-illegal metric and tag names, a locked and a read-only MLflow store, and
the errors that must come before compute (validation files, async rewards, a reward metric
named like mrl's, another model at resume, special-token text in prompts)."""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mrl.checkpoint.lock import LOCK_FILE, RunLock
from tests.dist_util import REPO

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
REWARDS = Path(__file__).with_name("safety_rewards.py")
ONE_RANK = ["platform.ranks_per_node=1", "parallel.tensor=1"]


def mrl(*args, cwd=REPO, timeout=300, **kw):
    return subprocess.run([sys.executable, "-m", "mrl", *map(str, args)], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=timeout, **kw)


def errors(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


# --------------------------------------------------------------------------- before compute


def write_parquet(path: Path, **columns):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


def test_validation_files_are_checked_like_training_files(tmp_path):
    missing = tmp_path / "val.parquet"
    proc = mrl("validate", "jobs/quickstart_cpu.toml", f"data.val_files=['{missing}']")
    assert proc.returncode == 2 and len(errors(proc)) == 1, proc.stderr
    assert "data.val_files" in errors(proc)[0] and "does not exist" in errors(proc)[0]
    shaped = write_parquet(tmp_path / "other.parquet", question=["1+1"], answer=["2"])
    proc = mrl("validate", "jobs/quickstart_cpu.toml", f"data.val_files=['{shaped}']")
    assert proc.returncode == 2 and "has no column 'prompt' (data.prompt_key); columns: question, answer" in proc.stderr
    good = write_parquet(tmp_path / "good.parquet", prompt=["1+1"], answer=["2"])
    assert mrl("validate", "jobs/quickstart_cpu.toml", f"data.val_files=['{good}']").returncode == 0


def test_an_async_reward_is_awaited():
    from mrl.reward.compose import Rewarder, RewardSample
    from mrl.reward.config import RewardConfig

    assert mrl("validate", "jobs/quickstart_cpu.toml", f"reward.function={REWARDS}:asynchronous").returncode == 0
    with Rewarder.from_config(RewardConfig(function=f"{REWARDS}:asynchronous", workers=1)) as r:
        res = r.score([RewardSample(0, "q", "4", "4"), RewardSample(1, "q", "5", "4")])
    assert res.scores == [1.0, 1.0] and not res.errors   # not "unpicklable" coroutines


def test_a_tag_key_with_at_validates_and_is_renamed_at_tracker_start(tmp_path):
    import io

    from mlflow.tracking import MlflowClient

    from mrl.tracking.config import TrackingConfig
    from mrl.tracking.tracker import Tracker

    assert mrl("validate", "jobs/quickstart_cpu.toml", "tracking.tags={'owner@team' = 'rl'}").returncode == 0
    stream = io.StringIO()
    t = Tracker(TrackingConfig(backends=("mlflow",), tags={"owner@team": "rl"}), run_dir=tmp_path, total_steps=1,
                rank=0, stream=stream)
    t.finish()
    tags = MlflowClient(t.mlflow.tracking_uri if t.mlflow else f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(
        t.run_id).data.tags
    assert tags["owner_at_team"] == "rl" and "'owner@team'" in stream.getvalue()


def test_a_reward_metric_named_mean_does_not_overwrite_the_sources_mean():
    from mrl.reward.compose import Rewarder, RewardSample
    from mrl.reward.config import RewardConfig

    with Rewarder.from_config(RewardConfig(function=f"{REWARDS}:named_like_mrl", workers=1)) as r:
        res = r.score([RewardSample(0, "q", "4", "4"), RewardSample(1, "q", "5", "4")])
    assert res.stats["reward/named_like_mrl/mean"] == 0.5            # the source's mean score
    assert res.stats["reward/named_like_mrl/mean_metric"] == 0.25    # the reward's own `mean`
    assert res.stats["reward/named_like_mrl/pass@1"] == 0.5          # renamed only where MLflow needs it


def test_a_stale_lock_of_a_dead_process_is_said_and_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": int(dead.stdout), "host": "h", "started": "t"}))
    said = []
    with RunLock(tmp_path, say=said.append) as lock:
        assert lock.took_over["pid"] == int(dead.stdout) and "took over the stale lock" in said[0]


# --------------------------------------------------------------------------- whole runs


def train_cmd(out: Path, *overrides) -> list[str]:
    return [sys.executable, "-m", "mrl", "train", "jobs/quickstart_cpu.toml", *ONE_RANK, f"job.output_dir={out}",
            "job.name=run", *map(str, overrides)]


def metric_steps(db: Path, key: str) -> list[int]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    (exp,) = [e for e in client.search_experiments() if e.name == "mrl"]
    (run,) = client.search_runs([exp.experiment_id])
    return sorted(m.step for m in client.get_metric_history(run.info.run_id, key))


def metric_steps_of(client, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


LOCK_STORE = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
db.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
db.execute("COMMIT")
"""


HELD_REWARD = """
import os, time

from tests.faults.safety_rewards import named_like_mrl as score


def held(prompt, response, ground_truth, extra):
    deadline = time.monotonic() + 240
    while os.path.exists({hold!r}) and time.monotonic() < deadline:   # the test's pacing
        time.sleep(0.1)
    return score(prompt, response, ground_truth, extra)
"""


@pytest.mark.slow
def test_two_launches_one_writer_and_a_locked_store_and_illegal_names_leave_the_run_training(tmp_path):
    """The first launch trains to the end with every metric while (1) a second launch of the same
    job exits 2 in one line naming it, (2) another writer holds the MLflow store locked for 10 s,
    (3) its reward logs `pass@1` and `mean`. It also takes over a dead process's stale lock.
    The first launch's rewards wait on a file the test removes, so the second launch surely
    meets a live first one."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_FILE).write_text(json.dumps({"pid": 999999, "host": "gone", "started": "earlier"}))
    hold = tmp_path / "hold"
    hold.touch()
    (tmp_path / "held_reward.py").write_text(HELD_REWARD.format(hold=str(hold)))
    steps = 3
    first = subprocess.Popen(train_cmd(tmp_path, f"trainer.total_steps={steps}", "reward.timeout_s=300",
                                       f"reward.function={tmp_path / 'held_reward.py'}:held"),
                             cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: f'"pid": {first.pid},' in (run_dir / LOCK_FILE).read_text(), 300, "the first launch's lock")
        second = subprocess.run(train_cmd(tmp_path, f"trainer.total_steps={steps}"), cwd=REPO, env=ENV,
                                capture_output=True, text=True, timeout=300)
        db = tmp_path / "mlflow.db"
        locker = subprocess.Popen([sys.executable, "-c", LOCK_STORE, str(db), "10"], stdout=subprocess.PIPE, text=True)
        assert locker.stdout.readline().strip() == "locked"
        hold.unlink()   # the first launch's step 1 now ends, and writes its metrics into the locked store
        locker.wait(timeout=60)
        out, err = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
    assert second.returncode == 2, second.stderr[-3000:]
    assert len(errors(second)) == 1 and "Traceback" not in second.stderr
    assert f"is in use by pid {first.pid} on " in errors(second)[0] and str(run_dir) in errors(second)[0]
    assert first.returncode == 0, err[-3000:]
    assert "took over the stale lock of pid 999999 on gone since earlier" in out + err
    assert out.count("'reward/held/pass@1' is not a legal MLflow name") == 1
    every = list(range(1, steps + 1))
    assert metric_steps(db, "reward/mean") == every
    assert metric_steps(db, "reward/held/pass_at_1") == every
    assert metric_steps(db, "reward/held/mean_metric") == every
    assert not (run_dir / "tracking_dropped.jsonl").exists()   # the locked store was waited for, nothing dropped
    assert (run_dir / LOCK_FILE).read_text() == ""             # released at the end

    # Then, side by side: another job starts from this run's checkpoint (a new MLflow run that says
    # where it came from; this run's rows untouched), and this run resumed with another model
    # (one line naming the differences, before megatron reads a tensor).
    ckpts = run_dir / "checkpoints" / "actor"
    loaded = subprocess.Popen(train_cmd(tmp_path, "job.name=other", f"checkpoint.load_from={ckpts}",
                                        f"trainer.total_steps={steps + 1}"),
                              cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    other_model = subprocess.run(train_cmd(tmp_path, f"trainer.total_steps={steps + 1}", "model.path=builtin:tiny-llama"),
                                 cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    out, err = loaded.communicate(timeout=600)
    assert loaded.returncode == 0, err[-3000:]
    assert other_model.returncode == 2 and len(errors(other_model)) == 1 and "Traceback" not in other_model.stderr
    assert "holds another model than the job's: embeddings tied (checkpoint) vs untied (job)" in errors(other_model)[0]
    assert "model_type qwen2 (checkpoint) vs llama (job)" in errors(other_model)[0]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("mrl").experiment_id])}
    assert set(runs) == {"run", "other"}
    first_id, new = runs["run"].info.run_id, runs["other"]
    assert new.data.tags["mrl.loaded_from"] == str(ckpts) and new.data.tags["mrl.loaded_from_step"] == str(steps)
    assert new.data.tags["mrl.loaded_from_run_id"] == first_id and new.data.params["job.name"] == "other"
    assert [m.step for m in client.get_metric_history(new.info.run_id, "reward/mean")] == [steps + 1]
    assert metric_steps_of(client, first_id, "reward/mean") == every   # the source run's rows are its own


def read_only_uri(db: Path) -> str:
    return f"sqlite:///file:{db}?mode=ro&uri=true"


@pytest.mark.slow
def test_a_read_only_store_leaves_the_run_training_and_the_journal_replays(tmp_path):
    from mlflow.tracking import MlflowClient

    db = tmp_path / "store" / "mlflow.db"
    db.parent.mkdir()
    MlflowClient(f"sqlite:///{db}").create_experiment("mrl")   # the store exists; this job cannot write it
    proc = subprocess.run(train_cmd(tmp_path, "trainer.total_steps=2", f"tracking.tracking_uri={read_only_uri(db)}",
                                    "tracking.retry_s=1"),
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "readonly database" in proc.stdout and "mrl track replay" in proc.stdout
    assert "step 2/2" in proc.stdout
    journal = tmp_path / "run" / "tracking_dropped.jsonl"
    ops = [json.loads(line)["op"] for line in journal.read_text().splitlines()]
    assert ops[0] == "start" and ops.count("metrics") >= 2 and ops[-1] == "finish"
    replay = mrl("track", "replay", tmp_path / "run", "--tracking-uri", f"sqlite:///{db}")
    assert replay.returncode == 0 and "replayed" in replay.stdout, replay.stderr
    assert metric_steps(db, "reward/mean") == [1, 2]
    assert metric_steps(db, "tracking/dropped_writes")[-1] == 2


@pytest.mark.slow
def test_a_second_launch_under_torchrun_is_one_line_printed_once(tmp_path):
    """The lock is held (by this test); a 2-rank launch of the job exits 2 with one error line:
    rank 0 tried the lock, rank 1 learned the outcome through the launch store."""
    with RunLock(tmp_path / "run"):
        proc = mrl("launch", "jobs/quickstart_cpu.toml", f"job.output_dir={tmp_path}", "job.name=run",
                   "trainer.total_steps=1", timeout=400)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors(proc)) == 1 and f"is in use by pid {os.getpid()}" in errors(proc)[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "mlflow.db").exists()   # refused before any MLflow access
