"""The code-execution reward: program extraction, test formats, comparison, and sandboxed runs of
correct, wrong and hostile programs (none of which may touch this machine or the run)."""
import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from mrl.reward.code import call_matches, code, extract_program, read_tests, stdout_matches
from mrl.reward.compose import Rewarder, RewardSample
from mrl.reward.config import CodeRewardConfig, RewardConfig
from mrl.reward.code_sandbox import Limits, isolation_mode
from mrl.reward.sources import reward_sources

ADD = {"inputs": ["1 2\n", "3 4\n", "10 -3\n"], "outputs": ["3\n", "7\n", "7"]}
# A generous wall clock where a program must finish (a loaded machine starts Python slowly); the
# hostile battery uses a short one so the hung cases end quickly.
FAST = {"wall_s": 10.0, "cpu_s": 1, "memory_mb": 256}
HOSTILE_WALL_S = 2.0


def fenced(program: str, lang: str = "python") -> str:
    return f"Here is my solution.\n```{lang}\n{program}\n```\nDone."


def test_extract_program_takes_the_last_python_block():
    text = "```python\nprint(1)\n```\ntext\n```python\nprint(2)\n```\n```\nplain\n```"
    assert extract_program(text) == "print(2)\n"
    assert extract_program("```\nprint(3)\n```") == "print(3)\n"
    assert extract_program("no code at all") is None


def test_read_tests_formats():
    stdio = read_tests(json.dumps(ADD))
    assert [t["kind"] for t in stdio] == ["stdio"] * 3 and stdio[2] == {"kind": "stdio", "input": "10 -3\n", "expected": "7"}
    call = read_tests({"fn_name": "f", "inputs": [[1, 2], 5], "outputs": [3, [5]]})
    assert call[0]["args"] == [1, 2] and call[1]["args"] == [5] and call[1]["expected"] == [5]
    mbpp = read_tests({"test_list": ["assert f(1) == 2"], "test_setup_code": "import math"})
    assert mbpp == [{"kind": "assert", "test": "assert f(1) == 2", "setup": "import math"}]
    assert read_tests(["assert True"])[0]["kind"] == "assert"
    for bad, message in [("not json", "not JSON"), (3, "cannot read test cases from a int"),
                         ({"inputs": [1], "outputs": []}, "same length")]:
        with pytest.raises(ValueError, match=message):
            read_tests(bad)


def test_comparisons():
    assert stdout_matches("3  \n7\n\n", "3\n7")
    assert stdout_matches("0.3333333\n", "0.33333333")
    assert not stdout_matches("3\n8\n", "3\n7\n") and not stdout_matches("3 7", "3")
    assert call_matches([1, 2], (1, 2)) and call_matches(5, [5]) and call_matches(0.1 + 0.2, 0.3)
    assert not call_matches([1, 2], [2, 1]) and not call_matches("1", 1)


def _code(program, tests=ADD, **kw):
    return code(None, fenced(program), tests, {}, **{**FAST, **kw})


def test_correct_wrong_and_partial_programs_are_scored_by_pass_rate_or_all_pass():
    right = "a, b = map(int, input().split())\nprint(a + b)"
    assert _code(right) | {} == pytest.approx({**_code(right), "score": 1.0, "passed": 3.0, "tests": 3.0})
    wrong = _code("a, b = map(int, input().split())\nprint(a - b)")
    assert wrong["score"] == 0.0 and wrong["wrong"] == 3.0
    partial = "a, b = map(int, input().split())\nprint(7 if a > 2 else 0)"   # passes tests 2 and 3
    assert _code(partial)["score"] == pytest.approx(2 / 3)
    strict = _code(partial, score="all_pass")
    assert strict["score"] == 0.0 and strict["wrong"] == 1.0 and strict["skipped"] == 2.0
    crash = _code("raise SystemError('boom')")
    assert crash["score"] == 0.0 and crash["error"] == 3.0
    assert _code("")["no_code"] == 1.0 and code(None, "no fence", ADD, {})["no_code"] == 1.0


def test_function_call_and_assert_tests_run_in_the_harness():
    calls = {"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [3, [7]]}
    assert _code("def add(a, b):\n    return a + b", calls)["score"] == 1.0
    assert _code("class Solution:\n    def add(self, a, b):\n        return a + b", calls)["score"] == 1.0
    assert _code("def add(a, b):\n    return a * b", calls)["score"] == 0.0
    asserts = ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]
    assert _code("def add(a, b):\n    return a + b", asserts)["score"] == 0.5
    # a program cannot pass by exiting before the tests or by printing what the harness would write
    for cheat in ("import sys\nsys.exit(0)", "import os\nos._exit(0)", "print('ok')\nimport os\nos.write(3, b'ok')"):
        assert _code(cheat, asserts)["score"] == 0.0, cheat


@pytest.fixture
def listener():
    """A TCP server on 127.0.0.1 that counts connections (a sandboxed program must not reach it)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    accepted = []

    def loop():
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            accepted.append(conn)

    threading.Thread(target=loop, daemon=True).start()
    yield sock.getsockname()[1], accepted
    sock.close()


@pytest.mark.slow   # a battery of sandboxed processes, about 7 s
def test_hostile_programs_score_zero_and_leave_the_machine_alone(tmp_path, listener):
    port, accepted = listener
    target = tmp_path / "outside.txt"
    ok_tail = "\na, b = map(int, input().split())\nprint(a + b)"   # would pass if the attack were harmless
    hostile = {
        "infinite loop": ("while True:\n    pass", ("cpu", "timeout")),
        "sleep": ("import time\ntime.sleep(60)", ("timeout",)),
        "10 GB allocation": ("x = bytearray(10 * 1024 ** 3)" + ok_tail, ("memory",)),
        "fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
                      ("timeout", "cpu")),
        "huge output": ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", ("output_limit",)),
        "write outside scratch": (f"open({str(target)!r}, 'w').write('pwned')" + ok_tail, ("error",)),
        "network call": (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)" + ok_tail,
                         ("error",)),
        "big file": ("open('big', 'wb').write(b'0' * (64 << 20))" + ok_tail, ("error",)),
    }
    if isolation_mode() == "rlimits":   # these two are what the weaker mode does not stop
        hostile.pop("write outside scratch"), hostile.pop("network call")
    one = {"inputs": ["1 2\n"], "outputs": ["3\n"]}
    started = time.monotonic()
    for name, (program, kinds) in hostile.items():
        hung = "timeout" in kinds   # only the cases that end by a limit get the short wall clock
        out = _code(program, one, **({"wall_s": HOSTILE_WALL_S} if hung else {}))
        assert out["score"] == 0.0, name
        assert sum(out[k] for k in kinds) == 1.0, (name, out)
    assert time.monotonic() - started < 40
    assert not target.exists() and not accepted
    time.sleep(0.2)
    leftovers = [p for p in os.listdir("/proc") if p.isdigit() and _uid(p) >= 200000]
    assert not leftovers, "sandboxed processes outlived their run"


def _uid(pid: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def test_scratch_directory_is_writable_and_private_per_run():
    writer = "open('note.txt', 'w').write('x')\nimport os\nprint(sorted(os.listdir('.')))"
    first = _code(writer, {"inputs": [""], "outputs": ["['note.txt', 'solution.py']"]})
    second = _code(writer, {"inputs": [""], "outputs": ["['note.txt', 'solution.py']"]})
    assert first["score"] == second["score"] == 1.0


def test_rlimits_mode_still_kills_hung_programs_and_their_children():
    out = code(None, fenced("import os, time\nif os.fork() == 0:\n    time.sleep(60)\ntime.sleep(60)"),
               {"inputs": [""], "outputs": [""]}, {}, isolation="rlimits", **{**FAST, "wall_s": 1.0})
    assert out["timeout"] == 1.0
    right = code(None, fenced("print(int(input()) * 2)"), {"inputs": ["4"], "outputs": ["8"]}, {}, isolation="rlimits", **FAST)
    assert right["score"] == 1.0


def test_code_builtin_through_the_rewarder_with_settings_and_budget():
    cfg = RewardConfig(builtin="code", workers=2, timeout_s=30.0,
                       code=CodeRewardConfig(score="all_pass", test_timeout_s=8.0, cpu_s=1))
    (src,) = reward_sources(cfg)
    assert src.kwargs["score"] == "all_pass" and src.kwargs["wall_s"] == 8.0 and src.kwargs["budget_s"] == 28.0
    samples = [RewardSample(0, "q", fenced("a, b = map(int, input().split())\nprint(a + b)"), json.dumps(ADD)),
               RewardSample(1, "q", fenced("while True: pass"), json.dumps(ADD)),
               RewardSample(2, "q", fenced("print(1)"), "not json"),
               RewardSample(3, "q", "I don't know", ADD, data_source="codecontests")]
    with Rewarder.from_config(cfg) as r:
        res = r.score(samples)
    assert res.source_scores["code"][:2] == [1.0, 0.0] and res.source_scores["code"][3] == 0.0
    assert [e.kind for e in res.errors] == ["exception"] and "not JSON" in res.errors[0].message
    assert res.stats["reward/code/no_code"] == pytest.approx(1 / 3)


def test_auto_routes_verl_code_sources_to_the_code_reward():
    cfg = RewardConfig(builtin="auto", workers=1, code=CodeRewardConfig(test_timeout_s=10.0))
    samples = [RewardSample(i, "q", fenced("print(sum(map(int, input().split())))"), ADD, data_source=s)
               for i, s in enumerate(("codecontests", "apps", "taco", "codeforces"))]
    with Rewarder.from_config(cfg) as r:
        res = r.score(samples)
    assert res.scores == [1.0] * 4 and not res.errors


def test_inside_a_landlocked_reward_worker_the_sandbox_still_isolates(tmp_path):
    """`mrl train` restricts reward workers with Landlock (no mounts there): their programs are
    started by the worker's launcher, forked before the restriction, in the full sandbox (its own
    root: the host's directories are not there, its /tmp is its own tmpfs)."""
    cfg = RewardConfig(builtin="code", workers=1, code=CodeRewardConfig(test_timeout_s=3.0))
    marker = str(tmp_path / "outside.txt")
    programs = {
        "pid namespace": ("import os\nprint(os.getpid())", {"inputs": [""], "outputs": ["2"]}, 1.0),
        "write outside": (f"open({marker!r}, 'w').write('x')\nprint(1)", {"inputs": [""], "outputs": ["1"]}, 0.0),
        "scratch works": ("open('a', 'w').write('5')\nprint(open('a').read())", {"inputs": [""], "outputs": ["5"]}, 1.0),
        "network": ("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)\nprint(1)",
                    {"inputs": [""], "outputs": ["1"]}, 0.0),
    }
    samples = [RewardSample(name, "q", fenced(p), tests) for name, (p, tests, _) in programs.items()]
    with Rewarder(reward_sources(cfg), workers=1, protect_dirs=(str(tmp_path),)) as r:
        res = r.score(samples)
    assert res.scores == [want for _, _, want in programs.values()] and not res.errors
    assert not os.path.exists(marker)


@pytest.mark.parametrize("got, expected, same", [
    ("42", "42", True), ("42", "+42", True), ("0.3333333", "0.33333333", True), ("1e3", "1000", True),
    ("1000.0", "1000", True), (".5", "0.5", True),
    ("４２", "42", False), ("4_2", "42", False), ("42", "４２", False), ("٤٢", "42", False), ("nan", "nan", True),
    ("nan", "NaN", False), ("inf", "1e999", False), ("infinity", "inf", False), ("0x2a", "42", False),
    ("12345678901234567891", "12345678901234567890", False), ("1e999", "1e999", True), ("1e999", "2e999", False),
])
def test_number_tokens_are_ascii_decimals_and_integers_compare_exactly(got, expected, same):
    assert stdout_matches(got, expected) is same


def test_call_values_compare_numbers_with_numbers_only():
    assert call_matches(42.0, 42) and call_matches(42, 42.0000001)
    assert not call_matches("４２", 42.0) and not call_matches("42", 42.0) and not call_matches(True, 1.0)


def test_number_tokens_property():
    """Any two ASCII integers compare as integers; any token with a non-ASCII digit or an
    underscore never equals a different token."""
    from hypothesis import given, strategies as st

    @given(st.integers(), st.integers())
    def integers(a, b):
        assert stdout_matches(str(a), str(b)) is (a == b)

    @given(st.integers(min_value=0), st.sampled_from(["_", "\\u0662", "\\uff12", " "]))
    def foreign(a, junk):
        text = str(a)
        mangled = text[:1] + junk.encode().decode("unicode_escape") + text[1:]
        assert not stdout_matches(mangled, text + "0")   # never a different number
        if junk != " ":
            assert not stdout_matches(mangled, text) or mangled == text

    integers()
    foreign()
