"""A reward for the loop's isolation test: misbehaves on some responses, scores the others."""
import math
import time
import zlib


def score(prompt, response, ground_truth, extra):
    kind = zlib.crc32(response.encode()) % 8
    if kind == 0:
        raise ValueError("user code failed")
    if kind == 1:
        time.sleep(3600)
    if kind == 2:
        return math.nan
    return sum(ch.isdigit() for ch in response[:8]) / 8
