"""tools/step_path.py, the count of issue 42's item 4: entries into the stage files of mrl/train/
along a call trace, by call site."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest

from tests.dist_util import REPO

spec = importlib.util.spec_from_file_location("step_path", REPO / "tools" / "step_path.py")
step_path = importlib.util.module_from_spec(spec)
spec.loader.exec_module(step_path)


def test_entries_count_calls_into_another_stage_file_and_returns_do_not():
    from mrl.train.produce import round_seed
    from mrl.train.step import staleness

    trace = step_path.PathTrace()
    sys.setprofile(trace)
    try:
        for _ in range(2):   # the second call: still in produce.py's place (this test is no stage)
            round_seed(1, 2, 3, 0)
        staleness([0], 1, 0)
        round_seed(1, 2, 3, 0)
    finally:
        sys.setprofile(None)
    # called from this test (not a stage file): the site is "-"
    assert trace.entries == [("-", "mrl/train/produce.py"), ("-", "mrl/train/step.py"), ("-", "mrl/train/produce.py")]
    assert trace.summary() == {"places": 2, "entries": 3, "sites": 2, "re-entries": 1, "re-entry sites": 0}


def test_bookkeeping_and_code_outside_mrl_train_stay_in_the_callers_place():
    import mrl.train.timer as timer

    here = timer.StageTimer(None)
    trace = step_path.PathTrace()
    sys.setprofile(trace)
    try:
        with here("x"):
            pass
    finally:
        sys.setprofile(None)
    assert trace.entries == []


# the stages of docs/design.md's data path, in its order; the path of step 1 enters each once
TAKE = ["mrl/train/step.py", "mrl/train/colocated.py"]
LEARN = ["mrl/train/batching.py",     # to a batch (with the rollout's MoE routes)
         "mrl/train/plan.py",         # the update's mini-batches (the plan's arithmetic)
         "mrl/train/moe.py",          # the moe/* metrics the step ends with (none for a dense actor)
         "mrl/train/engine_sync.py"]  # publish: the weights leave the trainer
PATHS = {
    "": TAKE + ["mrl/train/produce.py", "mrl/train/rollout.py", "mrl/train/scoring.py", "mrl/train/metrics.py"] + LEARN,
    "rollout.mode=server": TAKE + ["mrl/train/produce.py", "mrl/train/server_round.py", "mrl/train/scoring.py",
                                   "mrl/train/metrics.py", "mrl/train/carry.py"] + LEARN,
    "rollout.mode=server rollout.router=driver": TAKE + ["mrl/train/driver.py", "mrl/train/produce.py",
                                                         "mrl/train/server_round.py", "mrl/train/scoring.py",
                                                         "mrl/train/metrics.py", "mrl/train/carry.py"] + LEARN,
}


@pytest.mark.slow
def test_one_step_enters_each_place_once_in_the_order_of_the_data_path(tmp_path):
    """Step 1 of the quickstart (one process), colocated with whole rollouts, in server mode and
    with one router on the driver: every place is entered once (no re-entry), in the order of
    docs/design.md's data path. One process runs the three (`scripts/step_paths.py`)."""
    proc = subprocess.run([sys.executable, str(REPO / "tests/train/scripts/step_paths.py"), str(tmp_path), *PATHS],
                          cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    got = {int(i): json.loads(entries) for i, entries in re.findall(r"^PATH (\d+) (.*)$", proc.stdout, re.M)}
    for i, (overrides, places) in enumerate(PATHS.items()):
        assert [place for _, place in got[i]] == places, (overrides, got[i])
        sites = [site for site, _ in got[i]]
        assert sites[0].startswith("mrl/train/loop.py:") and sites[-1].startswith("mrl/train/loop.py:"), sites
