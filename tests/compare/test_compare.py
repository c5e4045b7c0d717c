"""`mrl compare`: run selection, spec differences, final/best metrics and plots.

The fast tests build MLflow stores the way the trainer does (`mrl.tracking.mlflow_run.MlflowRun`,
one sqlite store per run directory); the slow test compares two real `mrl train` runs.
"""
from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mrl.compare import compare
from mrl.compare.data import Point
from mrl.compare.metrics import best_mode, parse_choice, summarize
from mrl.compare.select import select_runs
from mrl.errors import UserError
from mrl.tracking.mlflow_run import MlflowRun, default_tracking_uri
from mrl.tracking.params import flatten

REPO = Path(__file__).resolve().parents[2]
_TEMPLATE: list[Path] = []  # an empty, migrated store: creating one costs seconds, copying it does not


def make_run(run_dir: Path, name: str, params: dict, metrics: dict[str, list[float]], *, experiment="mrl",
             spec_toml: str | None = None) -> str:
    db = run_dir / "mlflow.db"
    if not db.exists() and _TEMPLATE:
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_TEMPLATE[0], db)
    run = MlflowRun(default_tracking_uri(run_dir), experiment, name)
    run.log_params(params)
    for key, values in metrics.items():
        for step, value in enumerate(values, start=1):
            run.log_metrics({key: value}, step)
    if spec_toml is not None:
        run.log_text(spec_toml, "spec.toml")
    run.finish()
    return run.run_id


@pytest.fixture(scope="module", autouse=True)
def empty_store(tmp_path_factory):
    from mlflow.tracking import MlflowClient

    db = tmp_path_factory.mktemp("template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()  # creates and migrates the schema
    _TEMPLATE[:] = [db]
    yield
    _TEMPLATE.clear()


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    common = {"job.seed": "1", "rollout.temperature": "1.0"}
    a = make_run(root / "a", "a", {**common, "actor.optim.lr": "0.003"},
                 {"reward/mean": [0.1, 0.5, 0.3], "actor/pg_approx_kl": [0.02, 0.01, 0.03],
                  "actor/entropy": [6.0, 5.0, 4.0], "time/step": [2.0, 1.0, 1.5]},
                 spec_toml='[job]\nseed = 1\n\n[actor.optim]\nlr = 0.003\n\n[rollout]\ntemperature = 1.0\n')
    b = make_run(root / "b", "b", {**common, "actor.optim.lr": "0.001", "data.rows_read": "256"},
                 {"reward/mean": [0.2, 0.2], "actor/pg_approx_kl": [0.005, float("nan")],
                  "actor/entropy": [6.0, 5.5]})
    return root, a, b


def test_best_is_max_for_rewards_and_min_for_losses_kl_mismatch():
    assert best_mode("reward/mean") == "max" and best_mode("val/accuracy") == "max"
    assert best_mode("actor/pg_loss") == "min" and best_mode("actor/kl_loss") == "min"
    assert best_mode("actor/pg_approx_kl") == "min" and best_mode("rollout/kl_k3") == "min"
    assert best_mode("rollout/logprob_abs_diff_mean") == "min" and best_mode("kl/coef") == "min"
    assert best_mode("reward/errors") == "min"  # a count of failures, not a reward
    assert best_mode("actor/entropy") is None and best_mode("time/step") is None
    assert best_mode("actor/kludge") is None  # "kl" as a word only


def test_summary_final_and_best_skip_nan_and_keep_the_first_of_ties():
    pts = [Point(1, 0.2), Point(2, 0.7), Point(3, 0.7), Point(4, float("nan"))]
    s = summarize("reward/mean", pts)
    assert s.best == Point(2, 0.7) and s.final.step == 4 and math.isnan(s.final.value)
    assert summarize("actor/loss", pts).best == Point(1, 0.2)
    assert summarize("actor/entropy", pts).best is None


def test_spec_values_compare_whole_beyond_the_param_limit():
    assert flatten({"s": "y" * 7000}, limit=None) == {"s": "y" * 7000} != flatten({"s": "y" * 7000})


def test_metrics_option_rejects_unknown_group():
    with pytest.raises(UserError, match="--metrics rewards: not a metric group"):
        parse_choice("rewards")


def test_run_directories_diff_and_metrics(two_runs, tmp_path):
    root, a, b = two_runs
    out = tmp_path / "plots"
    c = compare([str(root / "a"), str(root / "b")], out=out)
    assert [(r.label, r.run_id) for r in c.runs] == [("a", a), ("b", b)]
    # lr differs; a key only one run logged shows as unset; equal keys are counted, not listed.
    assert dict(c.diff) == {"actor.optim.lr": ["0.003", "0.001"], "data.rows_read": [None, "256"]}
    assert c.same == 2
    assert c.metrics == ["reward/mean", "actor/pg_approx_kl", "actor/entropy", "time/step"]
    assert "actor/kl_loss" in c.not_logged and "response/length_mean" in c.not_logged
    ra, rb = c.summaries["reward/mean"]["a"], c.summaries["reward/mean"]["b"]
    assert (ra.final, ra.best, ra.mode) == (Point(3, 0.3), Point(2, 0.5), "max")
    assert (rb.final, rb.best) == (Point(2, 0.2), Point(1, 0.2))
    assert c.summaries["actor/pg_approx_kl"]["a"].best == Point(2, 0.01)
    assert c.summaries["actor/pg_approx_kl"]["b"].best == Point(1, 0.005)  # NaN is never best
    assert c.summaries["time/step"]["b"].final is None
    names = sorted(p.name for p in c.plots)
    assert names == sorted(["reward_mean.png", "actor_pg_approx_kl.png", "actor_entropy.png", "time_step.png",
                            "overview.png"])
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000 for p in c.plots)


def test_spec_toml_gives_exact_values_over_truncated_params(tmp_path):
    long = "x" * 7000  # MLflow params hold at most 6000 characters; the trainer truncates
    run_id = make_run(tmp_path / "r", "r", {"job.description": long[:5997] + "..."}, {"reward/mean": [1.0]},
                      spec_toml=f'[job]\ndescription = "{long}"\n')
    other = make_run(tmp_path / "s", "s", {"job.description": long[:5997] + "..."}, {"reward/mean": [1.0]},
                     spec_toml=f'[job]\ndescription = "{long[:-1]}y"\n')
    c = compare([str(tmp_path / "r"), str(tmp_path / "s")], metrics="reward", out=None)
    assert [r.run_id for r in c.runs] == [run_id, other]
    assert [k for k, _ in c.diff] == ["job.description"] and c.plots == []


def test_select_by_id_name_and_experiment_with_a_tracking_uri(tmp_path):
    store = tmp_path / "shared"
    first = make_run(store, "sweep-1", {"x": "1"}, {"reward/mean": [0.1]}, experiment="sweep")
    second = make_run(store, "sweep-2", {"x": "2"}, {"reward/mean": [0.2]}, experiment="sweep")
    other = make_run(store, "lonely", {"x": "3"}, {"reward/mean": [0.3]}, experiment="other")
    uri = [f"sqlite:///{store / 'mlflow.db'}"]
    assert [r.run_id for r in select_runs([second], uri)] == [second]
    assert [r.run_id for r in select_runs(["lonely"], uri)] == [other]
    assert [r.run_id for r in select_runs(["sweep", "sweep-1"], uri)] == [first, second]  # each run once
    # A run directory is accepted as --tracking-uri too.
    assert [r.run_id for r in select_runs(["sweep-2"], [str(store)])] == [second]
    with pytest.raises(UserError, match="^nope: no run id, run name or experiment of that name in sqlite:///"):
        select_runs(["nope"], uri)
    with pytest.raises(UserError, match="--tracking-uri .*/missing.db: no such sqlite file"):
        select_runs(["x"], [f"sqlite:///{tmp_path / 'missing.db'}"])


def test_names_are_looked_up_in_runs_star_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_id = make_run(tmp_path / "runs" / "job-x", "job-x", {}, {"reward/mean": [0.5]})
    assert [r.run_id for r in select_runs(["job-x"], cwd=tmp_path)] == [run_id]
    with pytest.raises(UserError, match="no store to look it up in"):
        select_runs(["job-x"], cwd=tmp_path / "runs")


def test_cli_user_errors_are_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mrl", "compare", str(tmp_path / "nowhere")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_two_short_trainings_with_different_lr(tmp_path):
    """The acceptance run: two 3-step CPU trainings that differ only in actor.optim.lr (one
    process, `run_jobs.py`: one `train()` after the other)."""
    from tests.train.test_train import run_jobs

    run_jobs("jobs/quickstart_cpu.toml", tmp_path, *(f"platform.ranks_per_node=1 parallel.tensor=1 trainer.total_steps=3 "
                                                    f"job.name={name} actor.optim.lr={lr}"
                                                    for name, lr in (("a", "3e-3"), ("b", "1e-3"))))
    out = tmp_path / "plots"
    proc = subprocess.run([sys.executable, "-m", "mrl", "compare", str(tmp_path / "a"), str(tmp_path / "b"),
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if "actor.optim.lr" in line]
    assert len(rows) == 1 and "0.003" in rows[0] and "0.001" in rows[0], proc.stdout
    assert any("reward/mean" in line and "max" in line for line in proc.stdout.splitlines()), proc.stdout
    for name in ("reward_mean.png", "actor_entropy.png", "response_length_mean.png",
                 "rollout_logprob_abs_diff_mean.png", "time_step.png", "overview.png"):
        assert (out / name).is_file(), f"{name} missing: {sorted(p.name for p in out.iterdir())}"


def test_curves_are_labelled_by_the_keys_that_differ(two_runs):
    from mrl.compare.report import curve_labels

    root, a, b = two_runs
    runs = select_runs([str(root / "a"), str(root / "b")])
    diff = [("actor.optim.lr", ["0.003", "0.001"]), ("job.name", ["a", "b"]), ("data.rows_read", [None, "256"])]
    assert curve_labels(runs, diff) == {"a": "a: actor.optim.lr=0.003",
                                        "b": "b: actor.optim.lr=0.001, data.rows_read=256"}


def test_a_run_directory_finds_its_runs_in_the_shared_store_of_its_output_directory(tmp_path):
    out = tmp_path / "runs"
    first = make_run(out, "exp-a", {"actor.optim.lr": "1"}, {"reward/mean": [0.1]})
    make_run(out, "exp-b", {"actor.optim.lr": "2"}, {"reward/mean": [0.2]})
    (out / "exp-a").mkdir()   # the run directory (checkpoints); its metrics are in runs/mlflow.db
    assert [r.run_id for r in select_runs([str(out / "exp-a")])] == [first]
    assert len(select_runs([str(out)])) == 2   # the output directory: every run of the project
    assert [r.run_id for r in select_runs(["exp-a"], cwd=tmp_path)] == [first]   # runs/mlflow.db by default
