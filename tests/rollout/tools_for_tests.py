"""Tools the multi-turn tests call (loaded by file path in a child process)."""
import os
import time


def echo(text):
    return f"echo:{text}"


def sleepy(seconds):
    time.sleep(seconds)
    return "woke up"


def broken(x):
    raise RuntimeError(f"bad input {x}")


def crash():
    os._exit(3)


def structured(a, b):
    return {"sum": a + b}


def which_rank():
    return f"rank {os.environ.get('RANK')}"
