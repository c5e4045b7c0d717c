"""Server mode with real tool servers: a multi-turn job's conversations run as coroutines through a
`ServerRollout` over two engine groups (two engines behind one router), calling tools on an HTTP
tool server (mrl's protocol, in a thread of this process) and an MCP server (stdio, a subprocess).
The engines are scripted (`FakeAsyncEngine`: a random model calls no tools); the tools, their
servers, the agent loop, the router and the server-mode rollout are the real ones."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from mrl.rollout.agent_loop import AgentRunner, AsyncTools, TrajectorySpec, tool_agent
from mrl.rollout.config import MultiTurnConfig, ToolServerConfig
from mrl.rollout.router import Router
from mrl.rollout.server import ServerRollout
from mrl.rollout.tool_formats import HermesFormat
from mrl.rollout.tools import ToolRunner
from mrl.rollout.turns import TurnTemplate
from mrl.rollout.types import Sampling
from mrl.rollout.vllm_async import LoopThread
from tests.rollout.fake_async import FakeAsyncEngine
from tests.rollout.servers import http_tool_server
from tests.rollout.test_agent_loop import TOK, call

MCP_SERVER = str(Path(__file__).parent / "servers" / "mcp_tool_server.py")


def test_a_3s_tool_call_on_a_server_does_not_delay_the_other_trajectories():
    """Trajectory "slow" calls the HTTP server's `sleepy(3)`; five others call `lookup` on the HTTP
    server and `add` on the MCP server, then answer. The five finish before the slow one (whose tool
    holds only its own coroutine); the tool answers are in their masked tool turns; both engine
    groups served, each trajectory's turns on one of them (sticky)."""
    http, url = http_tool_server.start()
    mt = MultiTurnConfig(enable=True, max_parallel_calls=2, servers=(
        ToolServerConfig(name="web", kind="http", url=url, tools=("lookup", "sleepy")),
        ToolServerConfig(name="mcp", kind="mcp_stdio", command=sys.executable, args=(MCP_SERVER, "stdio"),
                         tools=("add",))))
    runner = ToolRunner.from_config(mt)
    finished: dict[str, float] = {}

    def answer(ids):
        text = TOK.decode(ids)
        turns = ([call("sleepy", seconds=3), "slept<|im_end|>"] if "slow" in text else
                 [call("lookup", key="alpha")[:-len("<|im_end|>")] + call("add", a=7, b=35), "It is 42.<|im_end|>"])
        return TOK.encode(turns[1 if "<tool_response>" in text else 0])

    async def timed(ctx):
        t = await tool_agent(ctx)
        finished[ctx.key] = time.monotonic()
        return t

    engines = [FakeAsyncEngine(answer, name="e0"), FakeAsyncEngine(answer, name="e1")]
    agents = AgentRunner(Router(engines), timed, tools=AsyncTools(runner), tokenizer=TOK,
                         turns=TurnTemplate(TOK, runner.schemas()), format=HermesFormat(), multi_turn=mt)
    server = ServerRollout(engines, LoopThread(), agents, timeout_s=120)
    try:
        keys = ["slow"] + [f"fast{i}" for i in range(5)]
        specs = [TrajectorySpec(k, i, TOK.encode(f"{k}: ")) for i, k in enumerate(keys)]
        result = server.run_groups(specs, Sampling(max_tokens=2000))
    finally:
        server.shutdown()
        http.shutdown()
    order = sorted(finished, key=finished.get)
    assert order[-1] == "slow" and sorted(order[:-1]) == keys[1:], order
    by_key = dict(zip(keys, result.trajectories))
    slow = by_key.pop("slow")
    assert slow.finish_reason == "stop" and "<tool_response>\nawake\n</tool_response>" in TOK.decode(slow.token_ids)
    assert TOK.decode(slow.token_ids).endswith("slept<|im_end|>")
    for t in by_key.values():
        text = TOK.decode(t.token_ids)
        assert t.finish_reason == "stop" and t.info["tool_calls"] == 2 and t.info["tool_errors"] == 0
        assert "<tool_response>\n7\n</tool_response>\n<tool_response>\n42\n</tool_response>" in text
        assert text.endswith("It is 42.<|im_end|>")
        masked = TOK.decode([x for x, m in zip(t.token_ids, t.loss_mask) if m == 0])
        assert "42" in masked and "It is" not in masked
    assert http.calls >= 6   # 5 lookups and the slow call
    served = [(name, r.request_id.rsplit("-", 1)[0]) for e in engines for name, r in e.served]
    assert {name for name, _ in served} == {"e0", "e1"}
    assert all(len({n for n, k in served if k == key}) == 1 for key in keys)
