"""The quickstart digits reward (jobs/tasks/digits.py), taking `sleep_s` seconds per call.

A stand-in for a latency-bound verifier (a sandboxed code run, a remote judge): the wait costs
wall-clock time on the rollout side but no CPU, so it is the knob tools/bench/async_overlap.py
turns to make the rollout stage as long as the training stage.

    reward.function = "tools/bench/slow_reward.py:score"
    reward.kwargs = {sleep_s = 0.05}
"""
import importlib.util
import time
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "mrl_bench_digits", Path(__file__).resolve().parents[2] / "jobs" / "tasks" / "digits.py")
_digits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_digits)


def score(prompt, response, ground_truth, extra, sleep_s: float = 0.0):
    time.sleep(sleep_s)
    return _digits.score(prompt, response, ground_truth, extra)
