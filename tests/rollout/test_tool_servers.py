"""Tool servers: mrl's HTTP tool protocol and MCP (stdio and streamable HTTP) against servers this
test starts; timeouts, tool and server errors, oversized answers, allowlists and name clashes;
verl's tool file; a multi-turn rollout whose tools live on the servers."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from mrl.config.loader import load
from mrl.errors import SpecError, UserError
from mrl.rollout.config import MultiTurnConfig, ToolServerConfig
from mrl.rollout.multi_turn import MultiTurnRollout
from mrl.rollout.tool_servers import server_problems
from mrl.rollout.tool_servers.base import normalize_schema
from mrl.rollout.tool_schema import function_schema
from mrl.rollout.tools import ToolCall, ToolResult, ToolRunner, tool_counts, tool_metrics
from mrl.rollout.types import Response, Sampling
from tests.rollout.servers import http_tool_server
from tests.rollout.test_multi_turn import TOK, ScriptedEngine, call, spans

HERE = Path(__file__).parent
REPO = HERE.parents[1]
MCP_SERVER = str(HERE / "servers" / "mcp_tool_server.py")
QUICKSTART = str(REPO / "jobs" / "quickstart_cpu.toml")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def http_server():
    server, url = http_tool_server.start()
    yield server, url
    server.shutdown()


def start_mcp_http(port: int) -> subprocess.Popen:
    """An MCP server on streamable HTTP at http://127.0.0.1:`port`/mcp in a subprocess, once it listens."""
    proc = subprocess.Popen([sys.executable, MCP_SERVER, "http", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            assert proc.poll() is None, "the MCP server exited"
            time.sleep(0.2)
    return proc


@pytest.fixture(scope="module")
def mcp_http_url():
    """An MCP server on streamable HTTP in a subprocess; its endpoint URL."""
    port = free_port()
    proc = start_mcp_http(port)
    yield f"http://127.0.0.1:{port}/mcp"
    proc.kill()
    proc.wait()


def runner(*servers: ToolServerConfig, refs=(), **kw) -> ToolRunner:
    return ToolRunner.from_config(MultiTurnConfig(enable=True, tools=tuple(refs), servers=servers, **kw))


def stdio(name="mcp", **kw) -> ToolServerConfig:
    return ToolServerConfig(name=name, kind="mcp_stdio", command=sys.executable, args=(MCP_SERVER, "stdio"), **kw)


def test_schema_forms():
    simple = {"name": "f", "description": "d", "parameters": {"type": "object", "properties": {"x": {}}}}
    openai = {"type": "function", "function": simple}
    assert normalize_schema(simple, "t") == normalize_schema(openai, "t") == openai
    assert normalize_schema({"name": "g", "inputSchema": {"type": "object"}}, "t")["function"]["parameters"] == {"type": "object"}
    assert normalize_schema({"name": "h"}, "t")["function"]["parameters"] == {"type": "object", "properties": {}}
    for bad in ({"description": "no name"}, {"name": "f", "parameters": {"type": "string"}}, "f"):
        with pytest.raises(ValueError):
            normalize_schema(bad, "t")


def test_http_tools_answers_errors_timeouts_and_truncation(http_server):
    server, url = http_server
    r = runner(ToolServerConfig(name="web", kind="http", url=url, timeout_s=1.0), max_tool_result_bytes=100)
    try:
        assert [s["function"]["name"] for s in r.schemas()] == [s["name"] for s in http_tool_server.SCHEMAS]
        t0 = time.monotonic()
        res = r.run([ToolCall("lookup", {"key": "alpha"}), ToolCall("add", {"a": 2, "b": 3}),
                     ToolCall("lookup", {"key": "zeta"}), ToolCall("boom", {}), ToolCall("bad_args", {}),
                     ToolCall("crash", {}), ToolCall("garbage", {}), ToolCall("sleepy", {"seconds": 30}),
                     ToolCall("big", {"n": 100_000}), ToolCall("nope", {})])
        assert time.monotonic() - t0 < 6   # in parallel; the sleeper abandoned at its timeout
        got = [(x.status, x.error, x.truncated) for x in res]
        assert got == [("ok", "", False), ("ok", "", False), ("error", "tool", False), ("error", "tool", False),
                       ("error", "tool", False), ("error", "server", False), ("error", "server", False),
                       ("timeout", "timeout", False), ("ok", "", True), ("error", "unknown", False)]
        assert [x.text for x in res[:5]] == ["7", "5", "error: lookup: no secret named 'zeta'", "error: boom: the tool broke",
                                              "error: bad_args: argument x is required"]
        assert res[5].text == "error: crash: tool server 'web' failed: HTTP 500 Internal Server Error"
        assert res[7].text == "error: sleepy timed out after 1 s"
        assert res[8].text == "x" * 100 + "\n[truncated: the answer is longer than 100 bytes]"
        assert tool_counts(res) == {"tool_calls": 10, "tool_errors": 6, "tool_timeouts": 1, "tool_server_errors": 2,
                                    "tool_truncated": 1, "tool_server_restarts": 0}
    finally:
        r.close()


def test_http_server_in_simple_form_with_an_allowlist_and_a_server_that_goes_away(monkeypatch):
    server, url = http_tool_server.start(simple=True)
    monkeypatch.setenv("MRL_TEST_TOOLS_AUTH", "Bearer s3")
    r = runner(ToolServerConfig(name="web", kind="http", url=url, tools=("lookup", "add"), headers={"X-Team": "rl"},
                                header_env={"Authorization": "MRL_TEST_TOOLS_AUTH"}))
    assert server.headers["X-Team"] == "rl" and server.headers["Authorization"] == "Bearer s3"
    assert r.names == ["lookup", "add"]
    assert r.run([ToolCall("lookup", {"key": "beta"}), ToolCall("boom", {})])[0].text == "3"
    assert r.run([ToolCall("boom", {})])[0].error == "unknown"   # not on the allowlist
    server.shutdown()
    server.server_close()
    [res] = r.run([ToolCall("add", {"a": 1, "b": 1})])
    assert (res.status, res.error) == ("error", "server") and "cannot reach" in res.text
    # one request per call: the service back on its port answers the next call, no restart needed
    again, _ = http_tool_server.start(simple=True, port=server.server_address[1])
    try:
        [res] = r.run([ToolCall("add", {"a": 1, "b": 1})])
        assert (res.status, res.text, res.restarted) == ("ok", "2", False)
    finally:
        again.shutdown()
        again.server_close()
        r.close()


def test_start_problems_are_one_line_naming_the_server(http_server):
    _, url = http_server
    dead = f"http://127.0.0.1:{free_port()}"
    cases = [
        (ToolServerConfig(name="gone", kind="http", url=dead), "server 'gone' (" + dead + "): cannot list its tools: cannot reach"),
        (ToolServerConfig(name="web", kind="http", url=url, tools=("lookup", "lookpu")),
         "server 'web' offers no tool 'lookpu' (it offers: lookup, add,"),
        (ToolServerConfig(name="nomcp", kind="mcp_http", url=dead + "/mcp", connect_timeout_s=10),
         f"MCP server 'nomcp' ({dead}/mcp): cannot list its tools: "),
        (ToolServerConfig(name="nocmd", kind="mcp_stdio", command="/nonexistent/server"),
         "MCP server 'nocmd' (/nonexistent/server): cannot list its tools: "),
    ]
    for cfg, expected in cases:
        with pytest.raises(UserError) as e:
            runner(cfg)
        assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(UserError, match=r"servers\[0\].header_env: server 'web': the environment variable 'MRL_UNSET_VAR' "):
        runner(ToolServerConfig(name="web", kind="http", url=url, header_env={"Authorization": "MRL_UNSET_VAR"}))
    with pytest.raises(UserError, match="tool 'lookup' of server 'b' is also offered by server 'a'"):
        runner(ToolServerConfig(name="a", kind="http", url=url), ToolServerConfig(name="b", kind="http", url=url))
    calc = str(REPO / "jobs/tools/calculator.py") + ":calculator"
    r = runner(ToolServerConfig(name="web", kind="http", url=url, tools=("add",)), refs=[calc])
    assert r.schemas() == [function_schema(calc), {"type": "function", "function": http_tool_server.SCHEMAS[1]}]
    r.close()
    with pytest.raises(UserError, match="tool 'echo' of server 'web' is also offered by rollout.multi_turn.tools"):
        http_tool_server.SCHEMAS.append({"name": "echo"})
        try:
            runner(ToolServerConfig(name="web", kind="http", url=url), refs=[str(HERE / "tools_for_tests.py") + ":echo"])
        finally:
            http_tool_server.SCHEMAS.pop()


def test_mcp_stdio_tools_errors_timeout_truncation_and_a_dying_server():
    r = runner(stdio(timeout_s=1.0), max_tool_result_bytes=50)
    try:
        assert r.names == ["lookup", "add", "sleepy", "boom", "big", "exit_now"]
        [lookup] = [s for s in r.schemas() if s["function"]["name"] == "lookup"]
        assert lookup["function"]["description"] == "The secret digit stored under `key`."
        assert lookup["function"]["parameters"]["required"] == ["key"]
        t0 = time.monotonic()
        res = r.run([ToolCall("lookup", {"key": "gamma"}), ToolCall("add", {"a": 2, "b": 5}),
                     ToolCall("sleepy", {"seconds": 30}), ToolCall("boom", {}), ToolCall("lookup", {"key": 3}),
                     ToolCall("big", {"n": 10_000})])
        assert time.monotonic() - t0 < 6
        assert [(x.status, x.error, x.truncated) for x in res] == [
            ("ok", "", False), ("ok", "", False), ("timeout", "timeout", False), ("error", "tool", False),
            ("error", "tool", True), ("ok", "", True)]
        assert [x.text for x in res[:3]] == ["9", "7", "error: sleepy timed out after 1 s"]
        assert res[3].text == "error: boom: Error executing tool boom" and res[4].text.startswith("error: lookup: Error executing")
        # the server process dies mid-call: that call is a server error, no hang; the next call restarts it
        [died] = r.run([ToolCall("exit_now", {})])
        assert (died.status, died.error) == ("error", "server") and "tool server 'mcp' failed" in died.text, died
        [after] = r.run([ToolCall("add", {"a": 1, "b": 1})])
        assert (after.text, after.restarted) == ("2", True), after
    finally:
        t0 = time.monotonic()
        r.close()
        assert time.monotonic() - t0 < 10


def _pid(path: Path) -> int:
    return int(path.read_text())


def _gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether process `pid` has exited (gone or a zombie) within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            return True
        time.sleep(0.05)
    return False


def test_a_killed_stdio_mcp_server_is_restarted_on_the_next_call_and_its_tools_rechecked(tmp_path):
    pid_file, without = tmp_path / "pid", tmp_path / "without"
    r = runner(stdio(env={"PID_FILE": str(pid_file), "WITHOUT_FILE": str(without)}))
    pids = [_pid(pid_file)]
    results = []
    try:
        results += r.run([ToolCall("add", {"a": 1, "b": 2})])
        os.kill(pids[0], signal.SIGKILL)
        assert _gone(pids[0])
        results += r.run([ToolCall("add", {"a": 1, "b": 2})])      # finds it dead: the model reads a server error
        assert (results[-1].error, results[-1].restarted) == ("server", False) and "tool server 'mcp' failed" in results[-1].text
        results += r.run([ToolCall("add", {"a": 2, "b": 2})])      # a fresh process answers
        assert (results[-1].text, results[-1].restarted) == ("4", True), results[-1]
        pids.append(_pid(pid_file))
        assert pids[1] != pids[0] and not _gone(pids[1], 0.0)
        # the next process comes back without an allowlisted tool: calls to it are server errors
        without.write_text("lookup\n")
        os.kill(pids[1], signal.SIGKILL)
        assert _gone(pids[1])
        results += r.run([ToolCall("lookup", {"key": "alpha"})])
        results += r.run([ToolCall("add", {"a": 3, "b": 3}), ToolCall("lookup", {"key": "alpha"})])
        pids.append(_pid(pid_file))
        assert [(x.text, x.restarted) for x in results[-2:]] == [
            ("6", True), ("error: lookup: tool server 'mcp' failed: the restarted server no longer offers 'lookup'", False)]
        assert results[-3].error == "server"
        assert r.names == ["lookup", "add", "sleepy", "boom", "big", "exit_now"]   # the prompt's tool list stays
        counts = tool_counts(results)
        assert (counts["tool_calls"], counts["tool_server_errors"], counts["tool_server_restarts"]) == (6, 3, 2)
        assert tool_metrics([Response(0, [1], [0.0], "stop", info=counts)])["tools/server_restarts"] == 2.0
    finally:
        r.close()
    assert all(_gone(p) for p in pids), pids   # no orphan server process


def test_a_restart_that_hangs_is_given_up_at_the_connect_timeout_and_tried_again_later(tmp_path):
    pid_file, hang = tmp_path / "pid", tmp_path / "hang"
    r = runner(stdio(connect_timeout_s=5.0, env={"PID_FILE": str(pid_file), "HANG_FILE": str(hang)}))
    pids = [_pid(pid_file)]
    try:
        hang.write_text("")
        os.kill(pids[0], signal.SIGKILL)
        assert _gone(pids[0])
        assert r.run([ToolCall("add", {"a": 1, "b": 1})])[0].error == "server"
        t0 = time.monotonic()
        [res] = r.run([ToolCall("add", {"a": 1, "b": 1})])    # the new process never lists its tools
        assert 5.0 <= time.monotonic() - t0 < 7.0
        assert (res.error, res.restarted) == ("server", False) and res.text.endswith(
            "failed: restart failed: no tool listing within connect_timeout_s = 5 s"), res
        pids.append(_pid(pid_file))
        assert pids[1] != pids[0] and _gone(pids[1])          # the hung process was stopped
        hang.unlink()
        [res] = r.run([ToolCall("add", {"a": 1, "b": 1})])    # the next call tries again
        assert (res.text, res.restarted) == ("2", True), res
        pids.append(_pid(pid_file))
    finally:
        r.close()
    assert all(_gone(p) for p in pids), pids


def test_an_mcp_server_that_keeps_dying_stops_being_restarted(tmp_path):
    from mrl.rollout.tool_servers.mcp_tools import MAX_RESTARTS

    pid_file = tmp_path / "pid"
    r = runner(stdio(env={"PID_FILE": str(pid_file)}))
    pids, results = [_pid(pid_file)], []
    try:
        for _ in range(MAX_RESTARTS):
            results += r.run([ToolCall("exit_now", {})])
            results += r.run([ToolCall("add", {"a": 1, "b": 1})])
            assert (results[-1].text, results[-1].restarted) == ("2", True), results[-1]
            pids.append(_pid(pid_file))
        results += r.run([ToolCall("exit_now", {})])
        for _ in range(3):   # past the bound: a counted server error at once, no restart tried
            t0 = time.monotonic()
            results += r.run([ToolCall("add", {"a": 1, "b": 1})])
            assert time.monotonic() - t0 < 0.5
            assert (results[-1].error, results[-1].restarted) == ("server", False), results[-1]
        assert _pid(pid_file) == pids[-1]
        counts = tool_counts(results)
        assert (counts["tool_server_errors"], counts["tool_server_restarts"]) == (MAX_RESTARTS + 4, MAX_RESTARTS)
    finally:
        r.close()
    assert all(_gone(p) for p in pids), pids


def test_mcp_streamable_http_with_an_allowlist(mcp_http_url, monkeypatch):
    monkeypatch.setenv("MRL_TEST_TOOLS_AUTH", "Bearer s3")
    r = runner(ToolServerConfig(name="remote", kind="mcp_http", url=mcp_http_url, tools=("add", "lookup"),
                                headers={"X-Test": "1"}, header_env={"Authorization": "MRL_TEST_TOOLS_AUTH"}))
    try:
        assert r.names == ["lookup", "add"]
        res = r.run([ToolCall("add", {"a": 20, "b": 22}), ToolCall("lookup", {"key": "alpha"})] * 4)
        assert [x.text for x in res] == ["42", "7"] * 4
    finally:
        r.close()


def test_an_mcp_http_session_that_broke_is_reopened_when_the_service_is_back():
    port = free_port()
    proc = start_mcp_http(port)
    r = runner(ToolServerConfig(name="remote", kind="mcp_http", url=f"http://127.0.0.1:{port}/mcp", timeout_s=5.0))
    try:
        assert r.run([ToolCall("add", {"a": 1, "b": 1})])[0].text == "2"
        proc.kill()
        proc.wait()
        [broke] = r.run([ToolCall("add", {"a": 1, "b": 1})])   # the service is down: a server error
        assert (broke.error, broke.restarted) == ("server", False), broke
        proc = start_mcp_http(port)   # a new process on the same endpoint
        [back] = r.run([ToolCall("add", {"a": 2, "b": 3})])    # the session is reopened on it
        assert (back.text, back.restarted) == ("5", True), back
    finally:
        r.close()
        proc.kill()
        proc.wait()


def test_close_is_bounded_and_idempotent_with_calls_in_flight():
    import threading

    r = runner(stdio(timeout_s=20.0))
    box = []
    worker = threading.Thread(target=lambda: box.append(r.run([ToolCall("sleepy", {"seconds": 60})])), daemon=True)
    worker.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    r.close()
    r.close()
    worker.join(25)
    assert time.monotonic() - t0 < 25 and not worker.is_alive()
    assert box[0][0].status in ("error", "timeout")


def test_server_config_problems_at_validation(tmp_path):
    cfg = MultiTurnConfig(servers=(ToolServerConfig(name="a", kind="http"),
                                   ToolServerConfig(name="a", kind="mcp_stdio", url="http://x", headers={"h": "v"}),
                                   ToolServerConfig(name="c", kind="mcp_http", url="ftp://x", command="y")))
    assert server_problems(cfg) == [
        ("rollout.multi_turn.servers[0].url", "server 'a' (kind http) needs a url"),
        ("rollout.multi_turn.servers[1].command", "server 'a' (kind mcp_stdio) needs a command"),
        ("rollout.multi_turn.servers[1].url", "applies to kinds 'http' and 'mcp_http' (server 'a' is mcp_stdio)"),
        ("rollout.multi_turn.servers[1].headers", "applies to kinds 'http' and 'mcp_http' (server 'a' is mcp_stdio)"),
        ("rollout.multi_turn.servers[2].url", "'ftp://x' is not an http:// or https:// URL"),
        ("rollout.multi_turn.servers[2].command", "applies to kind 'mcp_stdio' only (server 'c' is mcp_http)"),
        ("rollout.multi_turn.servers", "two tool servers are named 'a'"),
    ]
    job = tmp_path / "job.toml"
    job.write_text(f'extends = "{QUICKSTART}"\n[rollout.multi_turn]\nenable = true\n'
                   '[[rollout.multi_turn.servers]]\nname = "s"\nkind = "mcp_stdoi"\ncomand = "x"\n')
    with pytest.raises(SpecError) as e:
        load(job)
    assert any("rollout.multi_turn.servers[0].comand: unknown key; did you mean `rollout.multi_turn.servers[0].command`"
               in p for p in e.value.problems), e.value.problems
    assert any("servers[0].kind: 'mcp_stdoi' is not one of" in p and "did you mean 'mcp_stdio'" in p
               for p in e.value.problems), e.value.problems
    spec, _ = load(QUICKSTART, ['rollout.multi_turn.servers=[{name="w", kind="http", url="http://127.0.0.1:1"}]'])
    assert spec.rollout.multi_turn.servers == (ToolServerConfig(name="w", kind="http", url="http://127.0.0.1:1"),)


def _verl_files(tmp_path, servers: dict, entries: str) -> Path:
    tmp_path = Path(tempfile.mkdtemp(dir=tmp_path))
    (tmp_path / "mcp_servers.json").write_text(json.dumps({"mcpServers": servers}))
    path = tmp_path / "tool_config.yaml"
    path.write_text("tools:\n" + entries)
    return path


MCP_ENTRY = """  - class_name: verl.tools.mcp_search_tool.MCPSearchTool
    config: {type: mcp, timeout: 7, rate_limit: 10}
    mcp:
      mcp_servers_config_path: ./mcp_servers.json
      tool_selected_list: [add, lookup]
"""


def test_verl_tool_config_maps_mcp_entries_and_refuses_the_rest(tmp_path):
    stdio_server = {"command": sys.executable, "args": [MCP_SERVER, "stdio"], "env": {"X": "1"}}
    path = _verl_files(tmp_path, {"local tools": stdio_server}, MCP_ENTRY)
    r = ToolRunner.from_config(MultiTurnConfig(enable=True, tool_config=str(path)))
    try:
        assert r.names == ["lookup", "add"] and r.servers[0].timeout_s == 7.0
        assert [x.text for x in r.run([ToolCall("add", {"a": 1, "b": 2})])] == ["3"]
    finally:
        r.close()
    bad = _verl_files(tmp_path, {"sse": {"url": "http://h/sse", "auth_token": "t"}, "remote": {"url": "http://h/mcp"},
                                 "odd": {"cmd": "x"}},
                      MCP_ENTRY + """  - class_name: verl.tools.gsm8k_tool.Gsm8kTool
    config: {type: native}
    tool_schema: {type: function, function: {name: calc_gsm8k_reward}}
  - class_name: x.Y
    config: {type: benchmax}
""")
    lines = [f"{k}: {m}" for k, m in server_problems(MultiTurnConfig(tool_config=str(bad)))]
    assert lines == [
        f"rollout.multi_turn.tool_config: {bad}: tools[0]: ./mcp_servers.json: mcpServers.sse: the legacy SSE transport "
        "is not supported; mrl speaks streamable HTTP (an MCP endpoint such as http://host:8000/mcp)",
        f"rollout.multi_turn.tool_config: {bad}: tools[0]: ./mcp_servers.json: mcpServers.odd: needs a command (stdio) "
        "or a url (streamable HTTP)",
        f"rollout.multi_turn.tool_config: {bad}: tools[1] (verl.tools.gsm8k_tool.Gsm8kTool): a verl native tool class; "
        "mrl does not run verl's tool classes: name a Python function in rollout.multi_turn.tools, or serve the tool "
        "over HTTP or MCP ([[rollout.multi_turn.servers]], docs/tools.md)",
        f"rollout.multi_turn.tool_config: {bad}: tools[2] (x.Y): config.type 'benchmax' is not supported (mrl maps "
        "verl's 'mcp' entries)",
    ]
    # the selection names a tool no server of the entry offers: one line at start
    path = _verl_files(tmp_path, {"local tools": stdio_server}, MCP_ENTRY.replace("[add, lookup]", "[add, search]"))
    with pytest.raises(UserError, match=r"tools\[0\]: tool_selected_list names 'search', which no server"):
        ToolRunner.from_config(MultiTurnConfig(enable=True, tool_config=str(path)))
    # `mrl validate` reports the file's problems one line each, the path relative to the job file
    job = bad.parent / "job.toml"
    job.write_text(f'extends = "{QUICKSTART}"\n[rollout.multi_turn]\nenable = true\ntool_config = "{bad.name}"\n')
    with pytest.raises(SpecError) as e:
        load(job)
    assert sum("rollout.multi_turn.tool_config" in p for p in e.value.problems) == 4, e.value.problems


def test_a_multi_turn_rollout_calls_tools_on_http_and_mcp_servers(http_server):
    """Conversations call `lookup` on the HTTP server and `add` on the MCP server; the answers are
    in the masked tool turns, the counts in `Response.info` and the step metrics."""
    _, url = http_server
    tools = runner(ToolServerConfig(name="web", kind="http", url=url, tools=("lookup",)),
                   stdio(tools=("add", "sleepy"), timeout_s=1.0))
    try:
        script = [call("lookup", key="alpha") + call("add", a=7, b=35), call("sleepy", seconds=9), "It is 42.<|im_end|>"]
        mt = MultiTurnRollout(ScriptedEngine(script), TOK, tools, max_parallel_calls=2, max_assistant_turns=4)
        [r, r2] = mt.generate([TOK.encode("q:")], Sampling(n=2, max_tokens=1000))
        assert [m for m, _ in spans(r)] == [1, 0, 1, 0, 1]
        tool_turn = spans(r)[1][1]
        assert "<tool_response>\n7\n</tool_response>\n<tool_response>\n42\n</tool_response>" in tool_turn
        assert "error: sleepy timed out after 1 s" in spans(r)[3][1]
        assert r.info["tool_calls"] == 3 and r.info["tool_timeouts"] == 1 and r.info["tool_errors"] == 0
        assert tool_metrics([r, r2, Response(0, [1], [0.0], "stop")]) == {
            "tools/calls": 6.0, "tools/errors": 0.0, "tools/errors_timeout": 2.0, "tools/errors_server": 0.0,
            "tools/truncated": 0.0, "tools/server_restarts": 0.0}
    finally:
        tools.close()


def test_tool_counts_of_malformed_calls():
    assert tool_counts([ToolResult("error: malformed", "error", 0.0, "malformed")])["tool_errors"] == 1
    assert tool_metrics([Response(0, [1], [0.0], "stop")]) == {}


def test_bench_tool_servers_smoke():
    proc = subprocess.run([sys.executable, "tools/bench/tool_servers.py", "--only", "http,mcp_stdio", "--calls", "8",
                           "--batch", "4"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [line.split()[0] for line in proc.stdout.splitlines()] == ["http", "http", "mcp_stdio", "mcp_stdio"]


def test_a_process_that_exits_without_closing_its_runner_exits_and_stops_its_mcp_server(tmp_path):
    """No hang at exit and no orphan server (the runner's finalizer closes the session; the server also
    exits when its stdin closes)."""
    pid_file = tmp_path / "pid"
    script = (f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
              "from mrl.rollout.config import MultiTurnConfig, ToolServerConfig\n"
              "from mrl.rollout.tools import ToolRunner, ToolCall\n"
              f"s = ToolServerConfig(name='m', kind='mcp_stdio', command={sys.executable!r}, "
              f"args=({MCP_SERVER!r}, 'stdio'), env={{'PID_FILE': {str(pid_file)!r}}})\n"
              "r = ToolRunner.from_config(MultiTurnConfig(enable=True, servers=(s,)))\n"
              "print(r.run([ToolCall('add', {'a': 1, 'b': 2})])[0].text)\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "3", proc.stderr[-2000:]
    assert time.monotonic() - t0 < 30
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists() and \
            Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_a_run_lists_each_server_once_per_rank_that_calls_tools(http_server, tmp_path, monkeypatch):
    """Building a multi-turn job's prompts, generator and validation set lists the HTTP server's
    tools once on a rank that calls tools (its runner, owned by the generator) and never on another
    rank of the world, which takes rank 0's schemas from the broadcast."""
    import torch.distributed as dist

    from mrl.data.source import load_prompts
    from mrl.models.tokenizer import load_tokenizer
    from mrl.platform import collectives
    from mrl.rollout.multi_turn import job_tools
    from mrl.train.engine_groups import build_rollout, calls_tools
    from mrl.train.evaluate import validation_set
    from mrl.train.parts import Prompts, Run
    from mrl.train.plan import step_plan

    server, url = http_server
    job = tmp_path / "job.toml"
    job.write_text(f'extends = "{QUICKSTART}"\n[data]\nchat_template = true\nmax_prompt_tokens = 1024\n'
                   f'generator_size = 16\n[actor]\nmicro_batch_tokens = 2048\n'
                   f'[rollout.multi_turn]\nenable = true\n'
                   f'[[rollout.multi_turn.servers]]\nname = "web"\nkind = "http"\nurl = "{url}"\ntools = ["lookup"]\n')
    spec, _ = load(job)
    plan = step_plan(spec)
    tokenizer = load_tokenizer(spec.model)
    ctx = type("Ctx", (), {"role": "train", "rank": 0, "global_rank": 0, "device": "cpu"})()

    def build_rank(is_leader: bool):
        """What `mrl.train.build.build` does with the tools on one rank: prompts, generator, validation."""
        tools = job_tools(spec, calls_tools=calls_tools(spec, plan, ctx, is_leader=is_leader))
        prompts = Prompts(dataset=load_prompts(spec.data, tokenizer, "train", tools=tools.prompt_schemas), samplers={},
                          tool_schemas=tools.prompt_schemas)
        engine, generator, _ = build_rollout(spec, plan, ctx, tokenizer, is_leader=is_leader, tools=tools)
        run = Run(spec=spec, ctx=ctx, hf={}, tokenizer=tokenizer, total_steps=1, plan=plan)
        validation_set(run, prompts)
        return tools, prompts, generator

    before = server.listings
    tools, prompts, generator = build_rank(is_leader=True)   # rank 0 of the world, the generating leader
    try:
        assert server.listings - before == 1
        assert generator.tools is tools.runner and [t["function"]["name"] for t in tools.schemas] == ["lookup"]
        assert '"name": "lookup"' in prompts.dataset.items[0].text
    finally:
        tools.close()
    listed = [("ok", tools.schemas)]   # what rank 0 broadcast
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(collectives, "broadcast_object", lambda obj, name, src=0: listed[0])
    before = server.listings
    other, other_prompts, none = build_rank(is_leader=False)   # rank 1: a model-parallel follower, no engine
    assert server.listings == before and other.runner is None and none is None
    assert other.schemas == tools.schemas and other_prompts.dataset.items[0].text == prompts.dataset.items[0].text
    listed[0] = ("error", "rollout.multi_turn.servers[0]: server 'web': cannot list its tools")
    with pytest.raises(UserError, match="cannot list its tools"):   # rank 0's failure, on every rank
        job_tools(spec, calls_tools=False)
