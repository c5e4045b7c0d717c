"""The console at start and end of a run: a first line at once, phases with durations, a summary."""
import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from mrl.tracking.startup import LoadProgress, RunSummary, StartupLog

REPO = Path(__file__).resolve().parents[2]


def test_phases_say_how_long_the_previous_one_took():
    out = io.StringIO()
    log = StartupLog(out, rank_zero=True)
    log.say("mrl train job.toml: checking the job")
    time.sleep(0.2)
    line = log.say("spec ok: run directory /x", timed=True)
    assert line.startswith("spec ok (0.") and line.endswith("s): run directory /x")
    assert log.say("built", timed=True).startswith("built (0.")
    assert StartupLog(io.StringIO(), rank_zero=False).say("x") is None
    assert out.getvalue().splitlines()[0] == "mrl train job.toml: checking the job"


def test_weight_loading_progress_is_throttled_and_does_not_end_the_phase():
    out = io.StringIO()
    log = StartupLog(out, rank_zero=True)
    now = [100.0]
    progress = LoadProgress("actor weights", log=log, every_s=5.0, clock=lambda: now[0])
    phase_started = log._last
    for done, t in ((1, 101.0), (2, 104.9), (3, 105.0), (4, 107.0), (5, 110.5), (6, 111.0)):
        now[0] = t
        progress(done, 6)
    # one line per 5 s at most, and always the last
    assert progress.lines == ["loading actor weights 3/6 (5.0s)", "loading actor weights 5/6 (10.5s)",
                              "loading actor weights 6/6 (11.0s)"]
    assert log._last == phase_started   # progress lines are inside the phase: its line times all of it
    silent = LoadProgress("x", log=StartupLog(io.StringIO(), rank_zero=False), every_s=0)
    silent(1, 1)
    assert silent.lines == []


def test_summary_has_last_and_best_rewards_checkpoint_wall_time_and_next_commands():
    s = RunSummary()
    s.observe(1, {"reward/mean": 0.1})
    s.observe(2, {"reward/mean": 0.9, "val/reward_mean": 0.5})
    s.observe(3, {"reward/mean": 0.7})
    s.observe(3, {"reward/mean": float("nan")})
    head, nxt = s.lines(steps=3, wall_s=3725, checkpoint="/r/checkpoints/actor/step_00000003", run_dir="runs/x",
                        tracking_uri="sqlite:////r/mlflow.db")
    assert head == ("done: 3 steps in 1:02:05; reward last 0.7 (step 3), best 0.9 (step 2); "
                    "val reward last 0.5 (step 2), best 0.5 (step 2); final checkpoint /r/checkpoints/actor/step_00000003")
    assert nxt == "next: mrl merge runs/x runs/x/hf   mrl compare runs/x   mlflow ui --backend-store-uri sqlite:////r/mlflow.db"
    head, nxt = RunSummary().lines(steps=0, wall_s=1, checkpoint=None, run_dir="d", tracking_uri=None)
    assert head == "done: 0 steps in 0:00:01; no checkpoint saved" and nxt == "next: mrl compare d"


def test_mrl_train_speaks_before_it_imports_torch(tmp_path):
    """The first line comes before the spec is loaded (torch and the config take seconds)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RANK": "0"}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "mrl", "train", "jobs/quickstart_cpu.toml",
                             "trainer.total_steps=-1", f"job.output_dir={tmp_path}"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    seconds = time.monotonic() - t0
    out, err = proc.communicate(timeout=120)
    assert first == "mrl train jobs/quickstart_cpu.toml: checking the job\n"
    assert proc.returncode == 2 and "trainer.total_steps" in err
    # what was imported before the first line was printed: no torch (importtime lists imports in order)
    before = err.split("mrl.tracking.startup")[0]
    assert "mrl.cli" in before and not re.search(r"\|\s+torch$", before, re.M)
    assert re.search(r"\|\s+torch$", err, re.M)   # it is imported later (the check can see it)
    assert seconds < 3, seconds


def test_the_process_log_is_silent_until_a_training_command_starts_it(capsys, monkeypatch):
    """`mrl generate` writes JSONL on stdout: a weight load there must not print progress lines."""
    from mrl.tracking import startup

    log = startup.StartupLog(rank_zero=False)   # as the module's STARTUP begins
    monkeypatch.setattr(startup, "STARTUP", log)
    startup.LoadProgress("reward weights")(3, 3)
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    log.start()
    startup.LoadProgress("reward weights")(3, 3)
    assert capsys.readouterr().out.startswith("loading reward weights 3/3 (")
