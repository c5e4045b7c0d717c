"""A toy task a tiny random model can learn on a laptop CPU in minutes: answer in digits.

Prompts ask for a number; the reward is the fraction of the first `WINDOW` response characters
that are digits, so a random policy scores about 0.02 (10 of ~260 byte tokens) and every extra
digit moves the reward. It exercises the whole loop (rollout, isolated reward workers, GRPO,
weight sync) with a reward curve that visibly rises within a few dozen steps.
"""
import random

WINDOW = 8


def prompts(size: int, seed: int) -> list[dict]:
    """`size` prompts like "Pick a number between 12 and 97:" (the answer is unused by the reward)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        lo = rng.randint(0, 50)
        hi = lo + rng.randint(1, 50)
        rows.append({"prompt": f"Pick a number between {lo} and {hi}:", "answer": str(rng.randint(lo, hi))})
    return rows


def score(prompt, response: str, ground_truth, extra) -> dict:
    head = response[:WINDOW].ljust(WINDOW)
    digits = sum(ch.isdigit() for ch in head)
    return {"score": digits / WINDOW, "all_digits": float(digits == WINDOW)}
