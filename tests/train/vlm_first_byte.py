"""A reward for short VLM test runs: 1 when the response's first byte is odd, else 0. A random
tiny policy gets a spread of rewards from its first step (the quickstart's colour task scores ~0
then), so GRPO's advantages, gradients and optimizer state are nonzero in a 3-step run."""


def score(prompt, response: str, ground_truth, extra) -> float:
    return float(bool(response) and ord(response[0]) % 2 == 1)
