"""User reward code runs isolated: raises, hangs, crashes, NaN and non-numbers are counted, scored by
policy, and the batch still finishes within the timeout."""
import time
from pathlib import Path

import pytest

from mrl.errors import UserError
from mrl.reward.compose import Rewarder, RewardSample
from mrl.reward.pool import Call, RewardPool
from mrl.reward.sources import RewardSource

FUNCS = str(Path(__file__).with_name("user_rewards.py"))
TIMEOUT_S = 1.0


def samples(responses):
    return [RewardSample(sample_id=f"s{i}", prompt="q", response=r, ground_truth="ok") for i, r in enumerate(responses)]


@pytest.fixture(scope="module")
def picky():
    with Rewarder([RewardSource("picky", "function", f"{FUNCS}:picky")], workers=3, timeout_s=TIMEOUT_S) as r:
        r.score(samples(["ok"]))  # workers started and warm
        yield r


def test_every_failure_is_counted_and_the_batch_completes(picky, caplog):
    batch = samples(["ok", "raise", "hang", "nan", "string", "die", "no", "ok"])
    t0 = time.monotonic()
    result = picky.score(batch)
    elapsed = time.monotonic() - t0
    assert elapsed < TIMEOUT_S + 1.5, f"batch took {elapsed:.2f}s"
    assert result.scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]  # on_error = zero
    assert result.valid == [True] * 8
    kinds = {e.sample_id: e.kind for e in result.errors}
    assert kinds == {"s1": "exception", "s2": "timeout", "s3": "non_finite", "s4": "not_a_number", "s5": "crash"}
    s = result.stats
    assert (s["reward/errors"], s["reward/picky/errors/timeout"], s["reward/picky/errors/crash"]) == (5.0, 1.0, 1.0)
    assert s["reward/workers_replaced"] == 2.0  # the hung and the dead worker
    assert "reward picky failed on sample s2: timeout" in caplog.text
    assert "KeyError: 'no such thing' (user_rewards.py:" in next(e.message for e in result.errors if e.sample_id == "s1")
    # the metrics of dict returns: numeric keys only, NaN where a sample had none
    assert result.metrics["picky/length"][0] == 2.0 and "picky/note" not in result.metrics
    # the pool keeps working after replacing workers
    assert picky.score(samples(["ok", "ok", "ok"])).scores == [1.0, 1.0, 1.0]


def test_drop_and_fail_policies():
    src = [RewardSource("picky", "function", f"{FUNCS}:picky")]
    with Rewarder(src, workers=2, timeout_s=TIMEOUT_S, on_error="drop") as r:
        res = r.score(samples(["ok", "raise", "no"]))
        assert res.valid == [True, False, True] and res.stats["reward/dropped_responses"] == 1.0
        assert res.stats["reward/mean"] == 0.5  # over valid responses only
    with Rewarder(src, workers=2, timeout_s=TIMEOUT_S, on_error="fail") as r:
        with pytest.raises(UserError, match=r"reward picky failed on sample s1: non_finite: returned nan .*on_error = 'fail'"):
            r.score(samples(["ok", "nan"]))


def test_many_hangs_with_few_workers_take_one_timeout_per_wave():
    with RewardPool([f"{FUNCS}:hangs", f"{FUNCS}:half"], workers=2, timeout_s=0.5) as pool:
        pool.run([Call(f"{FUNCS}:half", ("", "", "", {}), {})])
        t0 = time.monotonic()
        out = pool.run([Call(f"{FUNCS}:hangs", ("", "", "", {}), {})] * 4 + [Call(f"{FUNCS}:half", ("", "", "", {}), {"bonus": 0.25})])
        elapsed = time.monotonic() - t0
    assert [o.error for o in out] == ["timeout"] * 4 + [None] and out[4].value == 0.75
    # 4 hangs on 2 workers: two waves of 0.5 s; replacements start in the background
    assert 1.0 <= elapsed < 1.0 + 2.0, elapsed
    # timeout precision: a killed call is reported within 0.2 s of its limit
    assert all(0.5 <= o.seconds < 0.7 for o in out[:4]), [o.seconds for o in out[:4]]


def test_a_function_that_cannot_load_is_a_user_error(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import not_a_module_anywhere\n\ndef score(p, r, g, e):\n    return 1.0\n")
    with pytest.raises(UserError, match="cannot be loaded: ModuleNotFoundError"):
        with RewardPool([f"{bad}:score"], workers=1, timeout_s=1.0) as pool:
            pool.run([Call(f"{bad}:score", ("", "", "", {}), {})])
