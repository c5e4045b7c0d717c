"""tools/step_path.py, the count of issue 42's item 4: entries into the stage files of mrl/train/
along a call trace, by call site."""
from __future__ import annotations

import importlib.util
import sys

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
