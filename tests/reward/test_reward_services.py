"""Reward services (`reward.url`) and judges (`[reward.judge]`) against local HTTP servers the
tests start on 127.0.0.1: batching, concurrency, retries, timeouts, a down service, parse
failures, and composition with function rewards."""
import math
import socket
import time
from pathlib import Path

import pytest

from mrl.errors import UserError
from mrl.reward.compose import Rewarder, RewardSample, scoring_budget_s
from mrl.reward.config import JudgeConfig, RemoteRewardConfig, RewardConfig
from mrl.reward.judge import judge_messages, parse_rating, template_problem
from mrl.reward.remote import RemoteScorer, RequestError, call_json
from mrl.reward.sources import reward_problems, reward_sources
from tests.reward.fake_services import serve

FUNCS = str(Path(__file__).with_name("user_rewards.py"))


@pytest.fixture
def service():
    server, url = serve("reward")
    yield server, url
    server.shutdown()
    server.server_close()


@pytest.fixture
def judge():
    server, url = serve("judge")
    yield server, url + "/v1/chat/completions"
    server.shutdown()
    server.server_close()


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def samples(*responses, truth="42"):
    return [RewardSample(f"s{i}", "q", r, truth, data_source="toy", extra={"level": 1}) for i, r in enumerate(responses)]


def test_remote_batches_scores_metrics_and_item_errors(service):
    server, url = service
    cfg = RewardConfig(url=url, remote=RemoteRewardConfig(batch_size=2, concurrency=2), workers=1)
    (src,) = reward_sources(cfg)
    assert (src.name, src.kind, src.ref) == ("remote", "remote", url)
    with Rewarder.from_config(cfg) as r:
        assert r.pool is None
        res = r.score(samples("it is 42", "no", "BAD", "42!", "7"))
    assert res.source_scores["remote"][:2] == [1.0, 0.0] and math.isnan(res.source_scores["remote"][2])
    assert res.scores == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert res.stats["reward/remote/errors/service_item"] == 1.0
    assert res.stats["reward/remote/length"] == pytest.approx((8 + 2 + 3 + 1) / 4)
    reqs = server.handler.requests
    assert sorted(len(q["items"]) for q in reqs) == [1, 2, 2]
    first = next(q for q in reqs if q["items"][0]["id"] == "s0")["items"][0]
    assert first == {"id": "s0", "prompt": "q", "response": "it is 42", "ground_truth": "42", "data_source": "toy",
                     "extra": {"level": 1}}


def test_retries_with_backoff_then_success_and_http_errors(service):
    server, url = service
    server.handler.fail_next = 2
    waits = []
    assert call_json(url, {"items": []}, timeout_s=5, retries=2, backoff_s=0.5, sleep=waits.append) == {"scores": []}
    assert waits == [0.5, 1.0]
    server.handler.fail_next = 5
    with pytest.raises(RequestError) as e:
        call_json(url, {"items": []}, timeout_s=5, retries=1, backoff_s=0.0)
    assert e.value.kind == "http" and "HTTP 503" in str(e.value) and "(2 attempts)" in str(e.value)
    server.handler.fail_next = 0


def test_timeout_is_counted_and_on_error_drop_and_fail_apply(service):
    server, url = service
    server.handler.delay_s = 1.0
    cfg = RewardConfig(url=url, on_error="drop", remote=RemoteRewardConfig(timeout_s=0.2, retries=0))
    with Rewarder.from_config(cfg) as r:
        res = r.score(samples("42"))
    assert res.valid == [False] and res.stats["reward/remote/errors/timeout"] == 1.0
    server.handler.delay_s = 0.0


def test_down_service_is_one_line_naming_the_url_and_does_not_hang(caplog):
    url = f"http://127.0.0.1:{_free_port()}/score"
    cfg = RewardConfig(url=url, remote=RemoteRewardConfig(batch_size=1, concurrency=2, retries=3, backoff_s=0.05))
    started = time.monotonic()
    with Rewarder.from_config(cfg) as r:
        res = r.score(samples(*["42"] * 20))
    assert time.monotonic() - started < 5
    assert res.scores == [0.0] * 20 and res.stats["reward/remote/errors/connection"] == 20.0
    service_lines = [r.getMessage() for r in caplog.records if url in r.getMessage()]
    assert len(service_lines) == 1 and "cannot be reached" in service_lines[0], service_lines
    assert service_lines[0].startswith("reward remote failed on 20 samples (first s0): connection: ")
    with pytest.raises(UserError, match=f"reward remote failed on sample s0: connection: {url} cannot be reached"):
        with Rewarder.from_config(RewardConfig(url=url, on_error="fail", remote=RemoteRewardConfig(retries=0))) as r:
            r.score(samples("42"))


def test_judge_over_chat_completions_composes_with_functions_and_counts_parse_failures(judge):
    server, url = judge
    cfg = RewardConfig(judge=JudgeConfig(url=url, model="fake-judge", system="Be strict."), sources=(
        {"name": "judge", "judge": True, "weight": 1.0},
        {"name": "len", "function": f"{FUNCS}:correct", "weight": 0.5},
    ), workers=1)
    with Rewarder.from_config(cfg) as r:
        res = r.score(samples("the answer is 42", "maybe 7", "???", truth="42"))
    assert res.source_scores["judge"][:2] == [1.0, 0.0] and math.isnan(res.source_scores["judge"][2])
    assert res.stats["reward/judge/errors/parse"] == 1.0 and res.stats["reward/judge/rating"] == 5.0
    request = server.handler.requests[0]
    assert request["model"] == "fake-judge" and request["max_tokens"] == 16 and request["temperature"] == 0.0
    assert request["messages"][0] == {"role": "system", "content": "Be strict."}
    assert "Reference answer:\n42\n\nResponse:\n" in request["messages"][1]["content"]
    assert [e.kind for e in res.errors] == ["parse"] and "Hmm, hard to say." in res.errors[0].message


def test_parse_and_template_rules():
    assert parse_rating("Score: 7/10", r"(-?\d+(?:\.\d+)?)", 0.1).value == {"score": pytest.approx(0.7), "rating": 7.0}
    assert parse_rating("[[YES]]", r"\[\[(YES|NO)\]\]", 1.0).error == "parse"     # matched but not a number
    assert parse_rating("nothing", r"\d+", 1.0).error == "parse"
    assert parse_rating("8", r"\d+", 1.0).value["score"] == 8.0                  # no group: the whole match
    assert template_problem("{prompt} {answer}") and "{answer}" in template_problem("{prompt} {answer}")
    assert template_problem("{prompt} {response} {ground_truth}") is None
    msgs = judge_messages("{prompt}|{response}", None, [{"role": "user", "content": "hi"}], "yo", None)
    assert msgs == [{"role": "user", "content": "hi|yo"}]


@pytest.mark.parametrize("cfg,key,message", [
    (RewardConfig(url="ftp://x"), "reward.url", "not an http:// or https:// URL"),
    (RewardConfig(sources=({"name": "j", "judge": True},)), "reward.sources[0].judge", "needs a [reward.judge] table"),
    (RewardConfig(judge=JudgeConfig(url="http://x", template="{answer}")), "reward.judge.template", "{answer}"),
    (RewardConfig(judge=JudgeConfig(url="http://x", pattern="(")), "reward.judge.pattern", "not a regular expression"),
    (RewardConfig(judge=JudgeConfig()), "reward.judge", "set reward.judge.url"),
    (RewardConfig(url="http://x", builtin="math"), "reward", "(got reward.builtin, reward.url)"),
    (RewardConfig(builtin="code", timeout_s=5.0), "reward.timeout_s", "needs at least 8 s"),
])
def test_service_source_problems(cfg, key, message):
    problems = reward_problems(cfg)
    assert any(k == key and message in m for k, m in problems), problems


def test_scoring_budget_covers_remote_retries():
    cfg = RewardConfig(url="http://127.0.0.1:1/x", remote=RemoteRewardConfig(batch_size=4, concurrency=2, timeout_s=10,
                                                                            retries=1, backoff_s=1))
    # 16 responses: 4 requests, 2 waves (+1 for rounding); each request up to 2 x 10 s + 2 s of backoff
    assert scoring_budget_s(cfg, 16) == pytest.approx(3 * 22.0)


def test_local_judge_on_a_tiny_model_counts_its_unparsable_answers():
    cfg = RewardConfig(judge=JudgeConfig(model="builtin:tiny-qwen2", max_tokens=4), workers=1)
    with Rewarder.from_config(cfg) as r:
        res = r.score(samples("42", "7", "x"))
    # a random model's 4 bytes rarely hold a number: each response is a score or a counted parse error
    parsed = [not math.isnan(v) for v in res.source_scores["judge"]]
    assert sum(parsed) + res.stats.get("reward/judge/errors/parse", 0.0) == 3
    assert all(e.kind == "parse" for e in res.errors)
    again = Rewarder.from_config(cfg).score(samples("42", "7", "x"))   # greedy: the same answers
    assert [e.message for e in again.errors] == [e.message for e in res.errors]
    with pytest.raises(UserError, match="reward.judge.model: cannot load '/nonexistent/judge'"):
        Rewarder.from_config(RewardConfig(judge=JudgeConfig(model="/nonexistent/judge")))


def test_bench_rewards_remote_smoke():
    import subprocess
    import sys

    from tests.dist_util import REPO

    proc = subprocess.run([sys.executable, "tools/bench/rewards.py", "--only", "remote"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [line.split(":")[0].split()[2] for line in proc.stdout.splitlines()] == ["1", "8", "32"]


def test_secret_headers_come_from_the_environment(service):
    from mrl.reward.remote import request_headers

    server, url = service
    cfg = RemoteRewardConfig(headers={"X-Team": "rl"}, header_env={"Authorization": "MRL_TEST_REWARD_AUTH"})
    assert request_headers(cfg, {"MRL_TEST_REWARD_AUTH": "Bearer s3"}) == {"X-Team": "rl", "Authorization": "Bearer s3"}
    with pytest.raises(UserError, match="reward.remote.header_env: the environment variable 'MRL_TEST_REWARD_AUTH'"):
        request_headers(cfg, {})


def test_wrong_answers_from_a_service_are_bad_response_errors(service):
    server, url = service
    for answer, fragment in [({"scores": []}, "answered 0 scores for 2 responses"), ({"x": 1}, "answered no 'scores' list")]:
        server.handler.answer = staticmethod(lambda payload, a=answer: a)
        with Rewarder.from_config(RewardConfig(url=url, remote=RemoteRewardConfig(retries=0))) as r:
            res = r.score(samples("42", "7"))
        assert res.stats["reward/remote/errors/bad_response"] == 2.0 and fragment in res.errors[0].message
