"""A slow but correct reward: one second per call, never failing (the digits task's score)."""
import time


def score(prompt, response, ground_truth, extra):
    time.sleep(1.0)
    return float(response.strip() == str(ground_truth).strip())
