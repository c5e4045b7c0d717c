"""The quickstart's reward (`jobs/tasks/digits.py:score`), which a test can hold at a point of a
run it chooses, so it can kill the run there without racing it (`test_server_resume.py`).

With `MRL_TEST_HOLD_WHEN` set (a path; the job lets the reward workers see it with
`reward.env_allow`), a call made once that path exists never returns (the test kills the run;
`reward.timeout_s` must outlast its wait). Before, and without it, the score is the quickstart's,
so a held run and an unheld one score the same responses the same.
"""
import importlib.util
import os
import time
from pathlib import Path

_spec = importlib.util.spec_from_file_location("digits", Path(__file__).resolve().parents[2] / "jobs/tasks/digits.py")
digits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(digits)


def score(prompt, response, ground_truth, extra):
    when = os.environ.get("MRL_TEST_HOLD_WHEN")
    while when and Path(when).exists():
        time.sleep(1)
    return digits.score(prompt, response, ground_truth, extra)
