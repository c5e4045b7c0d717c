"""Two-turn arithmetic chats for the CPU SFT job: a sum, then that sum doubled.

Each row is a `messages` conversation (system, user, assistant, user, assistant); the loss is on
both assistant turns only. A tiny random model learns the format and most sums in a minute.
"""
import random


def conversations(size: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"messages": [
            {"role": "system", "content": "Answer with a number."},
            {"role": "user", "content": f"{a}+{b}="},
            {"role": "assistant", "content": str(a + b)},
            {"role": "user", "content": "double it"},
            {"role": "assistant", "content": str(2 * (a + b))},
        ]})
    return rows
