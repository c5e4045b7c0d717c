"""Reward for the quickstart job: 1.0 when the last integer in the response equals the answer.

mrl calls `score(prompt, response, ground_truth, extra)` in an isolated worker process with a
timeout; it may return a float or a dict with a "score" key plus any metrics to log.
"""
import re

_INT = re.compile(r"-?\d+")


def score(prompt: str, response: str, ground_truth: str, extra: dict) -> dict:
    numbers = _INT.findall(response)
    correct = bool(numbers) and numbers[-1] == str(ground_truth).strip()
    return {"score": 1.0 if correct else 0.0, "acc": float(correct), "answered": float(bool(numbers))}
