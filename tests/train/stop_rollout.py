"""A reward that stops the rank scoring with it (SIGSTOP to the reward worker's parent, the
rollout rank) on its first call: a rollout rank that hangs without dying."""
import os
import signal


def score(prompt, response, ground_truth, extra):
    os.kill(os.getppid(), signal.SIGSTOP)
    return 0.0
