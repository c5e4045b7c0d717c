"""A toy task that pays for using tools: the answer lives on a tool server.

Prompts ask for a secret ("secret beta?", answered by `lookup` on the HTTP tool server) or a sum
("add 3 4?", answered by `add` on the MCP server). The reward is 1 when the response's last line
is the right answer. A policy that answers directly guesses (about 1 in 10 right); one that calls
the tool and copies its answer is right. `teacher` writes the warm-start transcripts: half call the
tool and copy its answer, half guess a digit, so a policy trained on them calls tools about half
the time, and reinforcement learning has to find that calling pays.
"""
from __future__ import annotations

import json
import random
import re

from tests.rollout.servers.http_tool_server import SECRETS

KEYS = sorted(SECRETS)


def prompts(size: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        if rng.random() < 0.5:
            key = rng.choice(KEYS)
            rows.append({"prompt": f"secret {key}?\n", "answer": SECRETS[key]})
        else:
            a, b = rng.randint(0, 4), rng.randint(0, 4)
            rows.append({"prompt": f"add {a} {b}?\n", "answer": str(a + b)})
    return rows


def tool_call(prompt: str) -> str:
    """The hermes tool call that answers `prompt`."""
    words = prompt.strip(" ?\n").split()
    if words[0] == "secret":
        body = {"name": "lookup", "arguments": {"key": words[1]}}
    else:
        body = {"name": "add", "arguments": {"a": int(words[1]), "b": int(words[2])}}
    return f"<tool_call>{json.dumps(body, separators=(',', ':'))}</tool_call>"


TOOL_ANSWER = re.compile(r"<tool_response>\s*(.*?)\s*</tool_response>", re.DOTALL)


def teacher(prompt: str, context: str, rng: random.Random, call_rate: float = 0.5) -> str:
    """The teacher's next assistant turn (without the end token) given the conversation so far."""
    answers = TOOL_ANSWER.findall(context)
    if answers:
        return answers[-1]
    return tool_call(prompt) if rng.random() < call_rate else str(rng.randint(0, 9))


def score(prompt, response: str, ground_truth, extra) -> dict:
    lines = response.strip().splitlines()
    answer = lines[-1].strip() if lines else ""
    used = bool(TOOL_ANSWER.search(response))
    return {"score": float(answer == ground_truth),
            "called_lookup": float(used and '"lookup"' in response),
            "called_add": float(used and '"add"' in response)}
