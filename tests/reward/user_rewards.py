"""Reward functions for the isolation tests: one per way user code can misbehave."""
import os
import time


def correct(prompt, response, ground_truth, extra):
    return {"score": float(response.strip() == ground_truth), "length": len(response), "note": "not logged"}


def half(prompt, response, ground_truth, extra, bonus=0.0):
    return 0.5 + bonus


def raises(prompt, response, ground_truth, extra):
    raise KeyError("no such thing")


def hangs(prompt, response, ground_truth, extra):
    while True:
        time.sleep(1)


def nan(prompt, response, ground_truth, extra):
    return float("nan")


def string(prompt, response, ground_truth, extra):
    return "1.0"


def dies(prompt, response, ground_truth, extra):
    os._exit(3)


def picky(prompt, response, ground_truth, extra):
    """Misbehaves by the response text, so one batch can hold every failure."""
    return {"raise": raises, "hang": hangs, "nan": nan, "string": string, "die": dies}.get(response, correct)(
        prompt, response, ground_truth, extra)


def sees_extra(prompt, response, ground_truth, extra):
    return float(extra["data_source"] == "src" and extra["level"] == 3)


def huge(prompt, response, ground_truth, extra):
    return 10**400


def beyond_float32(prompt, response, ground_truth, extra):
    return 1e39


def allocates(prompt, response, ground_truth, extra):
    block = bytearray(int(1.5 * 2**30))   # 1.5 GiB
    return float(len(block) > 0)


def chatty(prompt, response, ground_truth, extra):
    print("x" * 99 + "\n" * 1, end="")
    for _ in range(1000):
        print("y" * 99)
    return 1.0
