"""The code-execution reward: run the response's program against the row's tests in a sandbox.

`code(prompt, response, ground_truth, extra, **settings)` is the `reward.builtin = "code"` function
(and what `auto` uses for verl's code-contest data sources: codecontests, apps, codeforces, taco).
It runs in a reward worker like every rule reward; each test runs in its own sandboxed process
(`mrl.reward.code_sandbox`).

The program is the response's last ```python fenced block (else its last fenced block; verl's
`prime_code` takes the text after the last ```python). Tests (the ground truth, a dict or its JSON
text, verl/prime_code's formats):

- `{"inputs": [...], "outputs": [...]}`: stdin/stdout pairs; the program reads the input and
  passes when its stdout equals the output line by line (trailing whitespace ignored, numbers
  equal within 1e-6 relative).
- the same with `"fn_name": "f"`: call cases; `inputs[i]` is the argument list of a call to the
  top-level function `f` (or `Solution().f`), passing when the value equals `outputs[i]` (tuples
  as lists; an output wrapped in a one-element list also matches, as in APPS/TACO).
- a list of assert statements, or `{"asserts": [...]}` / `{"test_list": [...], "test_setup_code":
  ...}` (MBPP): each assert runs after the program.

Call and assert cases run in a harness that reads a fresh random nonce from a pipe before the
program runs and writes it with the result to its own channel afterwards, so a program that
exits early (`sys.exit`, `os._exit`) or prints "passed" does not pass. A program written to
attack the harness in its own process (walking the interpreter's frames to find the nonce) is
not stopped: the score measures behaviour, not adversarial proof.

Returns `{"score": pass rate (or 1/0 when score = "all_pass"), "passed": passing tests, "tests":
tests run, and per outcome the number of tests: "wrong", "error", "timeout", "cpu", "memory",
"output_limit", "skipped" (the call's time budget ran out), plus "no_code" (1 when the response
has no program) and "unreadable_tests"}`. Metrics are the batch means of these numbers.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from typing import Any

from mrl.reward.code_sandbox import Limits, run_sandboxed

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
OUTCOMES = ("wrong", "error", "timeout", "cpu", "memory", "output_limit", "skipped")
SOURCES = ("codecontests", "apps", "codeforces", "taco")   # verl's default_compute_score code sources

HARNESS = r'''
import json, os, sys
def _main():
    chan = int(os.environ.pop("MRL_CHANNEL_FD"))
    secret = int(os.environ.pop("MRL_SECRET_FD"))
    nonce = os.read(secret, 64)
    os.close(secret)
    write, dumps = os.write, json.dumps
    case = json.loads(open("_mrl_case.json").read())
    os.remove("_mrl_case.json")
    source = open("solution.py").read()
    g = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(compile(source, "solution.py", "exec"), g)
    except SystemExit:
        pass
    if case["kind"] == "assert":
        exec(compile(case.get("setup") or "", "setup", "exec"), g)
        exec(compile(case["test"], "test", "exec"), g)
        result = {"ok": True}
    else:
        name = case["fn_name"]
        fn = g.get(name)
        if fn is None and "Solution" in g:
            fn = getattr(g["Solution"](), name)
        if fn is None:
            raise NameError(f"no function {name!r}")
        value = fn(*case["args"])
        def plain(v):
            if isinstance(v, (list, tuple)):
                return [plain(x) for x in v]
            if isinstance(v, dict):
                return {str(k): plain(x) for k, x in v.items()}
            return v
        try:
            result = {"value": dumps(plain(value))}
        except (TypeError, ValueError):
            result = {"repr": repr(value)[:1000]}
    write(chan, nonce + b"\n" + dumps(result).encode())
_main()
'''


def extract_program(response: str) -> str | None:
    """The last ```python block, else the last fenced block of any language, else None."""
    blocks = _FENCE.findall(response)
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    if python:
        return python[-1]
    return blocks[-1][1] if blocks else None


def read_tests(ground_truth: Any) -> list[dict]:
    """The row's test cases as [{"kind": "stdio"|"call"|"assert", ...}]; raises ValueError naming
    what cannot be read (a reward error, not a wrong answer)."""
    tests = ground_truth
    if isinstance(tests, (bytes, str)):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as e:
            raise ValueError(f"code: the ground truth is text but not JSON test cases ({e.msg} at {e.pos})") from None
    if isinstance(tests, (list, tuple)) and all(isinstance(t, str) for t in tests):
        return [{"kind": "assert", "test": t, "setup": ""} for t in tests]
    if not isinstance(tests, dict):
        raise ValueError(f"code: cannot read test cases from a {type(tests).__name__}; expected "
                         "{'inputs': [...], 'outputs': [...]} (optionally 'fn_name') or a list of asserts")
    asserts = tests.get("asserts", tests.get("test_list"))
    if asserts is not None:
        setup = tests.get("test_setup_code") or tests.get("setup") or ""
        return [{"kind": "assert", "test": str(t), "setup": str(setup)} for t in asserts]
    inputs, outputs = tests.get("inputs"), tests.get("outputs")
    if not isinstance(inputs, (list, tuple)) or not isinstance(outputs, (list, tuple)) or len(inputs) != len(outputs):
        raise ValueError("code: test cases need 'inputs' and 'outputs' lists of the same length")
    fn_name = tests.get("fn_name")
    if fn_name:
        return [{"kind": "call", "fn_name": str(fn_name), "args": list(i) if isinstance(i, (list, tuple)) else [i],
                 "expected": o} for i, o in zip(inputs, outputs)]
    return [{"kind": "stdio", "input": i if isinstance(i, str) else "\n".join(map(str, i)) if isinstance(i, list)
             else str(i), "expected": o if isinstance(o, str) else "\n".join(map(str, o)) if isinstance(o, list)
             else str(o)} for i, o in zip(inputs, outputs)]


# a number token as a program prints one: ASCII digits only (`float()` also takes "４２", "4_2", "nan",
# "inf" and surrounding spaces, none of which a correct answer "42" is)
_INTEGER = re.compile(r"[+-]?[0-9]+", re.ASCII)
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)


def _token_equal(a: str, b: str) -> bool:
    """Equal strings, equal integers, or decimals within 1e-6 relative (1e-9 absolute); a token
    counts as a number only in ASCII decimal notation."""
    if a == b:
        return True
    if _INTEGER.fullmatch(a) and _INTEGER.fullmatch(b):
        return int(a) == int(b)
    if not (_DECIMAL.fullmatch(a) and _DECIMAL.fullmatch(b)):
        return False
    try:
        x, y = float(a), float(b)
    except (ValueError, OverflowError):
        return False
    return math.isfinite(x) and math.isfinite(y) and math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def stdout_matches(got: str, expected: str) -> bool:
    """Line by line, trailing whitespace and trailing blank lines ignored; tokens equal or close numbers."""
    g = [line.rstrip() for line in got.strip("\n").splitlines()]
    e = [line.rstrip() for line in expected.strip("\n").splitlines()]
    while g and not g[-1]:
        g.pop()
    while e and not e[-1]:
        e.pop()
    if g == e:
        return True
    gt, et = " ".join(g).split(), " ".join(e).split()
    return len(gt) == len(et) and all(_token_equal(a, b) for a, b in zip(gt, et))


def _value_equal(got: Any, expected: Any) -> bool:
    if isinstance(got, float) or isinstance(expected, float):   # numbers only: a string "４２" is not 42.0
        return (_is_number(got) and _is_number(expected)
                and math.isclose(float(got), float(expected), rel_tol=1e-6, abs_tol=1e-9))
    if isinstance(got, list) and isinstance(expected, list):
        return len(got) == len(expected) and all(_value_equal(a, b) for a, b in zip(got, expected))
    return got == expected


def call_matches(got: Any, expected: Any) -> bool:
    """The call's value equals the expected output, or the output wrapped in a one-element list."""
    if isinstance(expected, tuple):
        expected = list(expected)
    return _value_equal(got, expected) or (isinstance(expected, list) and len(expected) == 1
                                           and _value_equal(got, expected[0]))


def _checked(run):
    if run.status == "sandbox":   # a broken set-up is a reward error, not a wrong program
        raise RuntimeError(f"code: the sandbox could not start the program: "
                           f"{run.stderr_tail.decode('utf-8', 'replace').strip()[:300]}")
    return run


def run_case(program: str, case: dict, limits: Limits, isolation: str = "auto") -> str:
    """"passed", or the outcome kind of one test (see OUTCOMES)."""
    if case["kind"] == "stdio":
        run = _checked(run_sandboxed({"solution.py": program}, ["solution.py"], case["input"].encode(), limits,
                                     isolation))
        if run.status != "ok":
            return run.status
        return "passed" if stdout_matches(run.stdout.decode("utf-8", "replace"), case["expected"]) else "wrong"
    nonce = os.urandom(16).hex().encode()
    payload = {k: v for k, v in case.items() if k != "expected"}
    run = _checked(run_sandboxed({"solution.py": program, "_mrl_harness.py": HARNESS,
                                  "_mrl_case.json": json.dumps(payload)}, ["_mrl_harness.py"], b"", limits, isolation,
                                 secret=nonce))
    if run.status != "ok":
        return run.status
    head, _, body = run.channel.partition(b"\n")
    if head != nonce:
        return "error"   # the harness never finished (the program exited or replaced its output)
    try:
        result = json.loads(body)
    except json.JSONDecodeError:
        return "error"
    if case["kind"] == "assert":
        return "passed" if result.get("ok") is True else "wrong"
    if "value" not in result:
        return "wrong"
    return "passed" if call_matches(json.loads(result["value"]), case["expected"]) else "wrong"


def score_program(program: str | None, tests: list[dict], *, score: str = "pass_rate", limits: Limits = Limits(),
                  isolation: str = "auto", budget_s: float = math.inf, max_tests: int = 0) -> dict:
    """Run `tests` (the first `max_tests` when > 0) and score; see the module docstring for keys.
    In "all_pass" mode the first failing test ends the run (the rest count as "skipped")."""
    if max_tests > 0:
        tests = tests[:max_tests]
    counts = {k: 0 for k in OUTCOMES}
    out: dict[str, float] = {"score": 0.0, "passed": 0.0, "tests": float(len(tests)), "no_code": 0.0}
    if program is None or not program.strip():
        out["no_code"] = 1.0
        return {**out, **{k: float(v) for k, v in counts.items()}}
    end = time.monotonic() + budget_s
    passed = 0
    for i, case in enumerate(tests):
        if time.monotonic() + limits.wall_s + 1.0 > end:
            counts["skipped"] += len(tests) - i
            break
        result = run_case(program, case, limits, isolation)
        if result == "passed":
            passed += 1
            continue
        counts[result] += 1
        if score == "all_pass":
            counts["skipped"] += len(tests) - i - 1
            break
    out["passed"] = float(passed)
    if tests:
        out["score"] = float(passed == len(tests)) if score == "all_pass" else passed / len(tests)
    return {**out, **{k: float(v) for k, v in counts.items()}}


def code(prompt: Any, response: str, ground_truth: Any, extra: dict, *, score: str = "pass_rate",
         isolation: str = "auto", budget_s: float = math.inf, max_tests: int = 0, **limits: Any) -> dict:
    """The `code` builtin: the response's program against the row's tests (module docstring).
    Keyword arguments are the `reward.code` table (`mrl.reward.config.CodeRewardConfig`)."""
    tests = read_tests(ground_truth)
    return score_program(extract_program(response), tests, score=score, limits=Limits(**limits),
                         isolation=isolation, budget_s=budget_s, max_tests=max_tests)
