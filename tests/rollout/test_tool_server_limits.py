"""Tool servers' limits: an MCP answer over `MAX_MESSAGE_BYTES` (stdio through the `stdio_cap`
relay, streamable HTTP through the capped httpx2 client) is a counted server error the model
sees and never read whole; a session that let a call time out is restarted by the next call;
the relay's line cap, property-tested."""
from __future__ import annotations

import json
import os
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mrl.rollout.tool_servers import mcp_tools
from mrl.rollout.tool_servers.stdio_cap import TOO_LARGE, refusal, relay
from mrl.rollout.tools import ToolCall, tool_counts
from tests.rollout.test_tool_servers import free_port, runner, start_mcp_http, stdio
from mrl.rollout.config import ToolServerConfig


@pytest.fixture
def small_cap(monkeypatch):
    monkeypatch.setattr(mcp_tools, "MAX_MESSAGE_BYTES", 1 << 20)


def _over_cap_then_fine(r):
    [big] = r.run([ToolCall("big", {"n": 3 << 20})])
    assert (big.status, big.error) == ("error", "server") and "over 1048576 bytes" in big.text, big
    [small, fine] = r.run([ToolCall("big", {"n": 1000}), ToolCall("add", {"a": 1, "b": 1})])
    assert (small.text, fine.text, fine.restarted) == ("x" * 1000, "2", False)   # the session lives on
    assert tool_counts([big, small, fine])["tool_server_errors"] == 1


def test_an_mcp_stdio_answer_over_the_cap_is_refused_and_counted(small_cap):
    r = runner(stdio(timeout_s=20.0), max_tool_result_bytes=4 << 20)
    try:
        _over_cap_then_fine(r)
    finally:
        r.close()


def test_an_mcp_http_answer_over_the_cap_is_refused_and_counted(small_cap):
    port = free_port()
    proc = start_mcp_http(port)
    r = runner(ToolServerConfig(name="remote", kind="mcp_http", url=f"http://127.0.0.1:{port}/mcp", timeout_s=20.0),
               max_tool_result_bytes=4 << 20)
    try:
        _over_cap_then_fine(r)
    finally:
        r.close()
        proc.kill()
        proc.wait()


def test_a_session_that_timed_out_is_restarted_by_the_next_call():
    r = runner(stdio(timeout_s=1.0))
    try:
        [slow] = r.run([ToolCall("sleepy", {"seconds": 30})])
        assert (slow.status, slow.restarted) == ("timeout", False)
        [after] = r.run([ToolCall("add", {"a": 2, "b": 2})])
        assert (after.text, after.restarted) == ("4", True), after
        [again] = r.run([ToolCall("add", {"a": 2, "b": 3})])
        assert (again.text, again.restarted) == ("5", False)
    finally:
        r.close()


# --- the relay's line cap -----------------------------------------------------------------------

def _relayed(data: bytes, limit: int) -> bytes:
    src_r, src_w = os.pipe()
    dst_r, dst_w = os.pipe()
    out = []
    reader = threading.Thread(target=lambda: out.append(_read_all(dst_r)))
    reader.start()
    writer = threading.Thread(target=lambda: (os.write(src_w, data) if data else None, os.close(src_w)))
    writer.start()
    relay(src_r, dst_w, limit)
    os.close(dst_w)
    writer.join()
    reader.join()
    os.close(src_r)
    os.close(dst_r)
    return out[0]


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


MESSAGES = st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 3000)), max_size=12)


@settings(max_examples=60, deadline=None)
@given(messages=MESSAGES, limit=st.integers(40, 2000))
def test_the_relay_passes_lines_within_the_cap_and_replaces_the_others(messages, limit):
    lines = [json.dumps({"jsonrpc": "2.0", "id": i, "result": "x" * n}).encode() + b"\n" for i, n in messages]
    out = _relayed(b"".join(lines), limit).splitlines(keepends=True)
    assert len(out) == len(lines)
    for (i, _), line, got in zip(messages, lines, out):
        if len(line) <= limit + 1:
            assert got == line
        else:
            reply = json.loads(got)
            assert reply["id"] == i and TOO_LARGE in reply["error"]["message"]
        assert len(got) <= max(limit + 1, 300)


def test_an_oversized_line_without_an_id_is_dropped_and_a_string_id_kept():
    assert refusal(b'{"jsonrpc": "2.0", "result": "' + b"x" * 100, 10) == b""
    assert json.loads(refusal(b'{"id": "a\\"b", "result": "', 10))["id"] == 'a"b'
    assert _relayed(b'{"result": "' + b"x" * 500 + b'"}\n{"id": 1}\n', 100) == b'{"id": 1}\n'
    assert _relayed(b"no newline at the end", 100) == b"no newline at the end"


@pytest.mark.parametrize("command", ["/nonexistent/server", "no-such-command-xyz", "NOT_EXECUTABLE"])
def test_a_stdio_command_that_cannot_run_is_one_line(command, capfd, tmp_path):
    from mrl.errors import UserError

    if command == "NOT_EXECUTABLE":
        command = str(tmp_path / "server.py")
        (tmp_path / "server.py").write_text("print('hi')\n")
        os.chmod(command, 0o644)

    with pytest.raises(UserError, match=rf"cannot list its tools: cannot start '{command}': not an executable"):
        runner(ToolServerConfig(name="nocmd", kind="mcp_stdio", command=command))
    assert capfd.readouterr().err == ""   # nothing from the relay
