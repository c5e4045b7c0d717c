"""The bounded HTTP client (`mrl.platform.http`) and its three users (remote rewards, HTTP judges,
HTTP tool servers) against a hostile server on 127.0.0.1: slow bodies and heads, huge bodies,
malformed and hostile JSON, redirects across and within an origin. A property test draws random
answers and checks that every outcome is a reply or a counted failure, never a traceback, and
that an Authorization header never reaches another origin."""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mrl.errors import UserError
from mrl.platform import http
from mrl.reward.compose import Rewarder, RewardSample
from mrl.reward.config import JudgeConfig, RemoteRewardConfig, RewardConfig
from mrl.reward.judge import HttpJudge, content_text
from mrl.reward.remote import RequestError, call_json
from mrl.rollout.tool_servers.http_tools import HTTPToolServer
from tests.hostile_http import HostileServer, huge, redirect, reply, trickle


@pytest.fixture
def hostile():
    servers = []

    def make(respond=None):
        servers.append(HostileServer(respond))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def post(url, **kw):
    kw.setdefault("timeout_s", 5.0)
    kw.setdefault("max_bytes", 1 << 20)
    return http.request("POST", url, body=b"{}", headers={"Authorization": "Bearer s3cret"}, **kw)


# --- the client itself -------------------------------------------------------------------------

def test_a_trickled_body_fails_at_the_total_deadline_not_per_read(hostile):
    server = hostile(trickle(b'{"scores": [1.0]}' + b" " * 200, 0.05))
    with pytest.raises(http.HTTPFailure) as e:
        post(server.url, timeout_s=0.5)
    assert e.value.kind == "timeout"
    assert server.sent < len(b'{"scores": [1.0]}') + 200 + 200   # the client hung up before the end


def test_a_trickled_head_fails_at_the_total_deadline(hostile):
    server = hostile(trickle(b"{}", 0.05, in_head=True))
    with pytest.raises(http.HTTPFailure) as e:
        post(server.url, timeout_s=0.5)
    assert e.value.kind == "timeout"


@pytest.mark.parametrize("declared", [True, False])
def test_a_huge_body_is_not_read_past_the_cap(hostile, declared):
    server = hostile(huge(300 << 20, declared=declared))
    with pytest.raises(http.HTTPFailure) as e:
        post(server.url, max_bytes=1 << 20)
    assert e.value.kind == "too_large"
    server.stop.set()
    assert server.sent < 64 << 20   # socket buffers at most, never the 300 MB


def test_cut_keeps_the_first_bytes_past_the_cap(hostile):
    server = hostile(huge(10 << 20))
    r = post(server.url, max_bytes=1000, cut=True)
    assert (r.status, len(r.body)) == (200, 1001)


def test_a_redirect_to_another_origin_is_refused_and_the_header_never_leaves(hostile):
    other = hostile(reply(200, b'{"scores": [1.0]}'))
    server = hostile(redirect(other.url + "/steal"))
    with pytest.raises(http.HTTPFailure) as e:
        post(server.url)
    assert e.value.kind == "redirect" and "another origin" in str(e.value)
    assert other.heads == []


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_within_the_origin_is_followed_with_its_headers(hostile, status):
    def respond(server, conn, head):
        if head.startswith(b"POST /final") or head.startswith(b"GET /final"):
            reply(200, b'{"ok": 1}')(server, conn, head)
        else:
            redirect("/final", status)(server, conn, head)

    server = hostile(respond)
    r = post(server.url + "/start")
    assert (r.status, http.parse_json(r.body)) == (200, {"ok": 1})
    assert server.heads[1].split(b" ")[0] == (b"POST" if status in (307, 308) else b"GET")
    assert sum(b"authorization: bearer s3cret" in h.lower() for h in server.heads) == 2


@pytest.mark.parametrize("location", ["http://[::1", "http://127.0.0.1:99999/", "ftp://127.0.0.1/x", "//[bad"])
def test_a_redirect_to_an_invalid_or_foreign_url_is_one_failure(hostile, location):
    server = hostile(redirect(location))
    with pytest.raises(http.HTTPFailure) as e:
        post(server.url)
    assert e.value.kind == "redirect" and "\n" not in str(e.value)


def test_an_invalid_url_is_a_connection_failure():
    for url in ("http://[::1", "http://127.0.0.1:99999/", "ftp://127.0.0.1/", ""):
        with pytest.raises(http.HTTPFailure) as e:
            http.request("GET", url, timeout_s=1, max_bytes=10)
        assert e.value.kind == "connection"


def test_a_redirect_loop_ends(hostile):
    server = hostile(redirect("/again"))
    with pytest.raises(http.HTTPFailure) as e:
        post(server.url)
    assert e.value.kind == "redirect" and len(server.heads) == http.MAX_REDIRECTS + 1


@pytest.mark.parametrize("text, why", [
    ('{"scores": [' + "9" * 5000 + "]}", "digits"),
    ("[" * 100_000 + "]" * 100_000, "nested"),
    ("[" * 100 + "]" * 100, "nested"),
    ('{"a": ', "Expecting"),
    (b"\xff\xfe{}", "UTF-8"),
])
def test_parse_json_refuses_hostile_json_as_a_value_error(text, why):
    with pytest.raises(ValueError, match=why):
        http.parse_json(text)


def test_parse_json_reads_ordinary_json():
    assert http.parse_json(b'{"a": [1, 2.5, -' + b"9" * 100 + b', null]}') == {"a": [1, 2.5, -int("9" * 100), None]}


# --- remote rewards and judges ------------------------------------------------------------------

def samples(n=1):
    return [RewardSample(f"s{i}", "q", "r", "42", data_source="toy") for i in range(n)]


@pytest.mark.parametrize("respond, kind, timeout_s", [
    (trickle(b'{"scores": [1.0]}' + b" " * 100, 0.05), "timeout", 0.5),
    (reply(200, b'{"scores": [' + b"9" * 5000 + b"]}"), "bad_response", 30),
    (reply(200, b"[" * 100_000 + b"]" * 100_000), "bad_response", 30),
    (huge(200 << 20), "bad_response", 30),
])
def test_remote_reward_counts_hostile_answers_as_errors(hostile, monkeypatch, respond, kind, timeout_s):
    monkeypatch.setattr("mrl.reward.remote.MAX_RESPONSE_BYTES", 1 << 20)
    server = hostile(respond)
    cfg = RewardConfig(url=server.url, remote=RemoteRewardConfig(timeout_s=timeout_s, retries=0), workers=1)
    with Rewarder.from_config(cfg) as r:
        res = r.score(samples(2))
    assert res.stats[f"reward/remote/errors/{kind}"] == 2.0 and res.scores == [0.0, 0.0]


def test_remote_reward_does_not_send_its_header_env_across_a_redirect(hostile, monkeypatch):
    monkeypatch.setenv("MRL_TEST_REMOTE_TOKEN", "Bearer s3cret")
    other = hostile(reply(200, b'{"scores": [1.0]}'))
    server = hostile(redirect(other.url + "/steal"))
    cfg = RewardConfig(url=server.url, remote=RemoteRewardConfig(header_env={"Authorization": "MRL_TEST_REMOTE_TOKEN"},
                                                                 retries=0), workers=1)
    with Rewarder.from_config(cfg) as r:
        res = r.score(samples(1))
    assert res.stats["reward/remote/errors/http"] == 1.0
    assert server.got_header(b"authorization") and other.heads == []


def chat(content) -> bytes:
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()


@pytest.mark.parametrize("content, rating, error", [
    ([{"type": "text", "text": "Rating: "}, {"type": "text", "text": "7"}], 7.0, None),
    ([{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "Rating: 3"}], 3.0, None),
    (7, None, "parse"),
    ({"text": "Rating: 7"}, None, "parse"),
    ([{"type": "text", "text": 7}], None, "parse"),
    ([1, 2], None, "parse"),
])
def test_http_judge_reads_a_list_of_text_parts_and_counts_other_content(hostile, content, rating, error):
    server = hostile(reply(200, chat(content)))
    judge = HttpJudge(JudgeConfig(url=server.url, pattern=r"Rating: (\d+)"), RemoteRewardConfig(retries=0))
    [out] = judge([[{"role": "user", "content": "q"}]])
    assert out.error == error
    if rating is not None:
        assert out.value["rating"] == rating


def test_content_text_forms():
    assert content_text(None) == "" and content_text("a") == "a"
    assert content_text([{"type": "text", "text": "a"}, {"text": "b"}]) == "ab"
    assert content_text(3.5) is None and content_text([{"type": "text"}]) is None


# --- HTTP tool servers --------------------------------------------------------------------------

def test_a_trickled_tool_listing_fails_start_up_at_connect_timeout(hostile):
    server = hostile(trickle(b'{"tools": []}' + b" " * 200, 0.05))
    with pytest.raises(UserError, match="cannot list its tools: no answer within 0.5 s"):
        HTTPToolServer("slow", server.url, connect_timeout_s=0.5)


@pytest.mark.parametrize("respond, match", [
    (huge(100 << 20), "more than"),
    (reply(200, b'{"tools": [' + b"[" * 100_000 + b"]"), "not usable JSON|nested"),
    (redirect("http://127.0.0.1:1/tools"), "another origin"),
])
def test_a_hostile_tool_listing_is_one_line(hostile, respond, match):
    server = hostile(respond)
    with pytest.raises(UserError, match=match):
        HTTPToolServer("bad", server.url, connect_timeout_s=30)


# --- a property test over random answers --------------------------------------------------------

BODIES = st.one_of(
    st.just(b'{"scores": [1.0]}'),
    st.binary(max_size=64),
    st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(1, 6000).map(lambda n: b'{"scores": [' + b"1" * n + b"]}"),
    st.text(max_size=40).map(lambda t: json.dumps({"scores": [t]}).encode()),
)


@st.composite
def answers(draw):
    kind = draw(st.sampled_from(["reply", "trickle", "huge", "cross", "same", "close"]))
    status = draw(st.sampled_from([200, 200, 400, 404, 500, 503]))
    body = draw(BODIES)
    return kind, status, body


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(answer=answers())
def test_every_random_answer_is_a_reply_or_a_counted_failure(hostile, answer):
    kind, status, body = answer
    other = hostile(reply(200, b'{"scores": [1.0]}'))

    def respond(server, conn, head):
        if head.startswith(b"GET /final"):
            return reply(status, body)(server, conn, head)
        if kind == "reply":
            reply(status, body)(server, conn, head)
        elif kind == "trickle":
            trickle(body + b" " * 20, 0.02)(server, conn, head)
        elif kind == "huge":
            huge(8 << 20)(server, conn, head)
        elif kind == "cross":
            redirect(other.url + "/x")(server, conn, head)
        elif kind == "same":
            redirect("/final", 303)(server, conn, head)
        else:
            server.send(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n" + body[:10])

    server = hostile(respond)
    try:
        answer_ = call_json(server.url, {"items": []}, timeout_s=0.3, retries=0, backoff_s=0,
                            headers={"Authorization": "Bearer s3cret"}, max_bytes=1 << 20)
    except RequestError as e:
        assert e.kind in ("connection", "timeout", "http", "bad_response") and "\n" not in str(e)
    else:
        assert status < 300 and kind in ("reply", "same", "trickle")
        assert json.loads(json.dumps(answer_)) == answer_   # plain JSON within the bounds
    server.stop.set()
    assert other.heads == []
    assert math.isfinite(server.sent)
