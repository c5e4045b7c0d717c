"""Fault battery, rewards: values that are not finite float32, memory and output limits, exact drop
counts, and reward modules that fail while importing. Each is counted by kind or is one line."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from mrl.errors import UserError
from mrl.reward.compose import Rewarder, RewardSample, is_count
from mrl.reward.pool import Call, RewardPool
from mrl.reward.sources import RewardSource

FUNCS = str(Path(__file__).parents[1] / "reward" / "user_rewards.py")


def samples(responses):
    return [RewardSample(sample_id=f"s{i}", prompt="q", response=r, ground_truth="ok") for i, r in enumerate(responses)]


def call(name: str) -> Call:
    return Call(f"{FUNCS}:{name}", ("q", "r", "ok", {}), {})


def test_scores_beyond_float32_are_errors_by_kind_not_crashes():
    src = [RewardSource("huge", "function", f"{FUNCS}:huge"), RewardSource("f32", "function", f"{FUNCS}:beyond_float32"),
           RewardSource("nan", "function", f"{FUNCS}:nan")]
    with Rewarder(src, workers=2, timeout_s=5.0) as r:
        res = r.score(samples(["ok", "ok"]))
    assert res.scores == [0.0, 0.0]
    s = res.stats
    assert (s["reward/huge/errors/out_of_range"], s["reward/f32/errors/out_of_range"], s["reward/nan/errors/non_finite"]) \
        == (2.0, 2.0, 2.0)
    assert s["reward/errors"] == 6.0 and s["reward/failed_responses"] == 2.0
    assert "401 digits" in next(e.message for e in res.errors if e.source == "huge")


def test_memory_limit_fails_the_call_not_the_trainer():
    with RewardPool([f"{FUNCS}:allocates", f"{FUNCS}:half"], workers=1, timeout_s=20.0, memory_mb=512) as pool:
        out = pool.run([call("allocates"), call("half")])
    assert out[0].error == "memory" and "reward.memory_mb = 512" in out[0].message, out[0]
    assert out[1].value == 0.5   # the worker serves on
    with RewardPool([f"{FUNCS}:allocates"], workers=1, timeout_s=20.0, memory_mb=0) as pool:
        assert pool.run([call("allocates")])[0].value == 1.0   # 0 = no limit


def test_output_is_capped_per_call_and_counted(capfd):
    with Rewarder([RewardSource("chatty", "function", f"{FUNCS}:chatty")], workers=2, timeout_s=10.0,
                  max_output_bytes=1000) as r:
        res = r.score(samples(["a", "b", "c"]))
        time.sleep(0.2)
    printed = capfd.readouterr()
    assert res.scores == [1.0, 1.0, 1.0]
    assert res.stats["reward/output_truncated_calls"] == 3.0
    # 3 calls x 1000 bytes passed on out of 3 x ~100 kB printed
    assert 2000 <= printed.out.count("y") + printed.out.count("x") <= 3000, len(printed.out)


def test_drop_counts_every_response_left_out():
    with Rewarder([RewardSource("picky", "function", f"{FUNCS}:picky")], workers=2, timeout_s=2.0, on_error="drop") as r:
        res = r.score(samples(["ok", "raise", "nan", "ok"]))
    assert res.valid == [True, False, False, True]
    assert res.stats["reward/dropped_responses"] == 2.0 and res.stats["reward/failed_responses"] == 2.0
    assert is_count("reward/dropped_responses") and is_count("reward/picky/errors/timeout")
    assert not is_count("reward/mean") and not is_count("reward/picky/mean")


# A failing import is reported as soon as it fails (a generous readiness bound, so a loaded machine
# cannot turn it into a timeout); only the slow import waits for its (short) bound.
@pytest.mark.parametrize("body, match, ready_s", [
    ("import os\nos._exit(3)\n", "exited with code 3 while importing", 30.0),
    ("import sys\nsys.exit('no config')\n", "cannot be loaded: SystemExit: no config", 30.0),
    ("raise RuntimeError('bad setup')\n", r"cannot be loaded: RuntimeError: bad setup \(bad_import.py:1\)", 30.0),
    ("import time\ntime.sleep(30)\n", "did not finish importing them within 1.5 s", 1.5),
])
def test_import_time_failures_are_one_line(tmp_path, body, match, ready_s):
    bad = tmp_path / "bad_import.py"
    bad.write_text(body + "\ndef score(p, r, g, e):\n    return 1.0\n")
    t0 = time.monotonic()
    with pytest.raises(UserError, match=match) as err:
        with RewardPool([f"{bad}:score"], workers=2, timeout_s=1.0, ready_timeout_s=ready_s) as pool:
            pool.run([Call(f"{bad}:score", ("", "", "", {}), {})] * 3)
    assert "\n" not in str(err.value)
    assert time.monotonic() - t0 < 60   # fails fast: no waiting for a timeout that is not there


def test_the_batch_budget_bounds_a_batch_whose_workers_keep_dying(tmp_path):
    with RewardPool([f"{FUNCS}:hangs", f"{FUNCS}:half"], workers=2, timeout_s=0.5, ready_timeout_s=3.0) as pool:
        assert pool.batch_budget_s(4) == 3.0 + 2 * 1.5
        t0 = time.monotonic()
        out = pool.run([call("hangs")] * 4)
        elapsed = time.monotonic() - t0
    assert [o.error for o in out] == ["timeout"] * 4
    assert elapsed <= pool.batch_budget_s(4) + 0.5, elapsed


def test_one_worker_stuck_importing_is_replaced_while_the_others_serve(tmp_path, monkeypatch):
    marker = tmp_path / "first_import_was_slow"
    slow = tmp_path / "slow_once.py"
    # O_EXCL: exactly one worker (the first to create the marker) hangs, even when both import at once
    slow.write_text(f"import os, time\ntry:\n    os.close(os.open({str(marker)!r}, os.O_CREAT | os.O_EXCL))\n"
                    "except FileExistsError:\n    pass\nelse:\n    time.sleep(60)\n\n"
                    "def score(p, r, g, e):\n    time.sleep(0.5)\n    return 1.0\n")
    with RewardPool([f"{slow}:score"], workers=2, timeout_s=5.0, ready_timeout_s=2.0) as pool:
        out = pool.run([Call(f"{slow}:score", ("", "", "", {}), {})] * 10)
        assert [o.value for o in out] == [1.0] * 10 and pool.replacements == 1
