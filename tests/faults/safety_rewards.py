"""Rewards for the run-safety fault battery (tests/faults/test_run_safety_faults.py)."""


def named_like_mrl(prompt, response, ground_truth, extra):
    """A score with metrics MLflow rejects (`pass@1`) and one named like mrl's own (`mean`)."""
    ok = float(response.strip() == str(ground_truth).strip())
    return {"score": ok, "pass@1": ok, "mean": 0.25}


async def asynchronous(prompt, response, ground_truth, extra):
    return 1.0
