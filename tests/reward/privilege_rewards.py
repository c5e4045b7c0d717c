"""Reward functions that try to reach what a reward must not: secrets, the run directory, the
trainer after the run (a daemon), the trainer's unpickler."""
import os
import tempfile
import time


def environment(prompt, response, ground_truth, extra):
    """Which of the named variables this worker sees, and whether any of their values is in the
    environment block the process started with (/proc/self/environ)."""
    with open("/proc/self/environ", "rb") as f:
        block = f.read()
    return {"score": 1.0, "seen": sorted(k for k in extra["names"] if k in os.environ),
            "in_block": sorted(k for k in extra["names"] if extra["values"][k].encode() in block),
            "has_path": "PATH" in os.environ, "tmp": tempfile.gettempdir()}


def daemon(prompt, response, ground_truth, extra):
    """Double-fork a daemon in a new session that records its pid and sleeps."""
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            with open(extra["pidfile"], "w") as f:
                f.write(str(os.getpid()))
            time.sleep(120)
        os._exit(0)
    os.waitpid(pid, 0)
    for _ in range(200):
        if os.path.exists(extra["pidfile"]) and os.path.getsize(extra["pidfile"]):
            break
        time.sleep(0.01)
    return 1.0


def writes(prompt, response, ground_truth, extra):
    """Try to write into `extra["target"]`; a private temporary file must still work."""
    with tempfile.NamedTemporaryFile() as t:
        t.write(b"scratch")
    with open(os.path.join(extra["target"], "planted.txt"), "w") as f:
        f.write("from a reward")
    return 1.0


class SlowToUnpickle:
    """Unpickling this sleeps: a trainer that unpickled reward values would wait outside the timeout."""

    def __reduce__(self):
        return (time.sleep, (30,))


def slow_value(prompt, response, ground_truth, extra):
    return SlowToUnpickle()


class Score(float):
    """A float subclass defined in the reward file (the trainer cannot import this module)."""


def float_subclass(prompt, response, ground_truth, extra):
    return {"score": Score(0.75), "bonus": Score(2.0)}
