"""Server-mode rollouts on a fake AsyncEngine: the router, the agent loop, over-sampling and abort."""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from mrl.errors import UserError
from mrl.models.tokenizer import byte_tokenizer
from mrl.rollout.agent_loop import (AgentRunner, AsyncTools, Trajectory, TrajectorySpec, groups_to_submit, load_agent,
                                    single_turn, tool_agent)
from mrl.rollout.async_engine import GenRequest
from mrl.rollout.router import Router
from mrl.rollout.tool_formats import HermesFormat
from mrl.rollout.tools import ToolRunner
from mrl.rollout.turns import TurnTemplate
from mrl.rollout.types import Sampling

from .fake_async import FakeAsyncEngine

HERE = Path(__file__).parent
TOOLS = str(HERE / "tools_for_tests.py")
TOK = byte_tokenizer()


def call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call><|im_end|>'


def req(rid, max_tokens=10):
    return GenRequest(rid, (1, 2), Sampling(max_tokens=max_tokens))


def test_router_least_outstanding_work_and_sticky():
    async def main():
        a, b = FakeAsyncEngine(lambda p: [5] * 100, tick=0.01, name="a"), FakeAsyncEngine(lambda p: [5] * 100, tick=0.01, name="b")
        router = Router([a, b])
        t1 = asyncio.ensure_future(router.generate("t1", req("t1-0", 10)))   # -> a (both idle: lowest index)
        await asyncio.sleep(0)
        t2 = asyncio.ensure_future(router.generate("t2", req("t2-0", 4)))    # -> b (a has 10 outstanding)
        await asyncio.sleep(0)
        assert [load.outstanding for load in router.loads] == [10, 4]
        assert router.pick("t3") == 1                                         # least outstanding: b (4 < 10)
        t1b = asyncio.ensure_future(router.generate("t1", req("t1-1", 2)))  # sticky: t1 stays on a
        await asyncio.sleep(0)
        assert [load.outstanding for load in router.loads] == [12, 4]
        await asyncio.gather(t1, t2, t1b)
        assert [(name, r.request_id) for name, r in a.served + b.served] == [("a", "t1-0"), ("a", "t1-1"), ("b", "t2-0")]
        assert [load.outstanding for load in router.loads] == [0, 0]
        assert 0 < router.busy_fraction() <= 1
        router.release("t1")
        assert "t1" not in router.sticky
    asyncio.run(main())


def test_router_abort_returns_what_was_generated_and_refuses_later_requests():
    async def main():
        engine = FakeAsyncEngine(lambda p: list(range(100)), tick=0.01)
        router = Router([engine])
        running = asyncio.ensure_future(router.generate("t", req("t-0", 100)))
        await asyncio.sleep(0.05)
        await router.abort(["t"])
        out = await running
        assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 100
        assert out.token_ids == list(range(len(out.token_ids)))
        later = await router.generate("t", req("t-1"))
        assert later.finish_reason == "abort" and later.token_ids == []
    asyncio.run(main())


def _tool_runner(script_of, tools=("echo", "sleepy")):
    """A runner over a scripted engine: `script_of(prompt text)` -> the list of turns to answer with."""
    def answer(ids):
        text = TOK.decode(ids)
        turns = script_of(text)
        return TOK.encode(turns[min(text.count("</tool_response>"), len(turns) - 1)])

    runner = ToolRunner([f"{TOOLS}:{f}" for f in tools], 10.0)
    tools_ = AsyncTools(runner)
    mt = SimpleNamespace(enable=True, max_assistant_turns=None, max_user_turns=None, max_parallel_calls=1,
                         max_tool_response_tokens=256, tool_response_truncate_side="middle")
    engines = [FakeAsyncEngine(answer, name="e0"), FakeAsyncEngine(answer, name="e1")]
    agents = AgentRunner(Router(engines), tools=tools_, tokenizer=TOK, turns=TurnTemplate(TOK, runner.schemas()),
                         format=HermesFormat(), multi_turn=mt)
    return agents, engines, runner


def test_a_slow_tool_call_holds_only_its_own_trajectory():
    """Trajectory 0 calls a tool that takes 3 s; the 5 others call a fast one. Each is its own task:
    the others finish (three turns each) before trajectory 0's tool returns; everything is token in,
    token out, with tool tokens masked."""
    finished_at = {}

    def script(text):
        slow = "slow" in text
        first = call("sleepy", seconds=3) if slow else call("echo", text="x")
        return [first, call("echo", text="y"), "done<|im_end|>"]

    agents, engines, runner = _tool_runner(script)

    async def timed(spec, sampling):
        out = await agents.run([spec], sampling)
        finished_at[spec.key] = time.monotonic()
        return out

    async def main():
        prompts = [TOK.encode(("slow " if i == 0 else "fast ") + f"{i}") for i in range(6)]
        specs = [TrajectorySpec(f"t{i}", i, p) for i, p in enumerate(prompts)]
        return await asyncio.gather(*(timed(s, Sampling(max_tokens=600)) for s in specs))

    try:
        results = asyncio.run(main())
    finally:
        runner.close()
    order = sorted(finished_at, key=finished_at.get)
    assert order[-1] == "t0", order
    for r in results:
        [t] = r.trajectories
        assert t.finish_reason == "stop" and t.info["assistant_turns"] == 3 and t.info["tool_turns"] == 2
        assert t.info["tool_calls"] == 2 and t.info["tool_errors"] == 0
        assert TOK.decode(t.token_ids).endswith("done<|im_end|>")
        assert all(lp == -0.25 for lp, m in zip(t.logprobs, t.loss_mask) if m == 1)
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if m == 0) and 0 in t.loss_mask
    # both engines served; each trajectory's turns stayed on one engine (sticky)
    served = [(name, r.request_id.rsplit("-", 1)[0]) for e in engines for name, r in e.served]
    assert {name for name, _ in served} == {"e0", "e1"}
    assert all(len({n for n, k in served if k == key}) == 1 for key in finished_at)


def test_over_sampling_aborts_the_rest_once_enough_groups_finished_and_resume_continues():
    """6 groups of 2 for a step that needs 4: the groups of prompts "long" generate 300 tokens, the
    others 10. Once 4 groups finished the 2 long ones are aborted mid-generation; resumed, an
    aborted trajectory continues from its tokens to exactly the answer it would have given."""
    full = list(range(3, 303))
    answer = lambda p: (full[len(p) - 2:] if p[0] == 1 else [9] * 10)   # noqa: E731 - continues from the context
    engines = [FakeAsyncEngine(answer, tick=0.002), FakeAsyncEngine(answer, tick=0.002)]
    runner = AgentRunner(Router(engines), single_turn)
    specs = [TrajectorySpec(f"g{g}r{j}", g, [1, 2] if g in (0, 3) else [0, 2], seed=g) for g in range(6) for j in range(2)]
    assert groups_to_submit(4, 0.5) == 6 and groups_to_submit(4, 0.0) == 4 and groups_to_submit(8, 0.25) == 10

    result = asyncio.run(runner.run(specs, Sampling(max_tokens=400), needed=4))
    assert sorted(result.finished_groups) == [1, 2, 4, 5]
    assert result.aborted == 4
    for spec, t in zip(specs, result.trajectories):
        if spec.group in (0, 3):
            assert t.finish_reason == "abort" and 0 <= len(t.token_ids) < 300 and t.token_ids == full[:len(t.token_ids)]
        else:
            assert t.finish_reason == "stop" and t.token_ids == [9] * 10
    # a carried trajectory continues where it stopped (its own engine calls counted on)
    partial = result.trajectories[0]
    calls = partial.info["engine_calls"]
    resumed = asyncio.run(runner.run([TrajectorySpec("again", 0, [1, 2], seed=0, resume=partial)],
                                     Sampling(max_tokens=400)))
    [t] = resumed.trajectories
    assert t.finish_reason == "stop" and t.token_ids == full and t.logprobs == [-0.25] * 300
    assert t.info["engine_calls"] == calls + 1


def test_an_aborted_trajectory_waiting_for_its_tools_keeps_the_turn_and_runs_them_on_resume():
    def script(text):
        # the fast answer is long enough that the slow trajectory is in its tool call when it ends
        return [call("sleepy", seconds=3) if "slow" in text else "quick" * 40 + "<|im_end|>", "done<|im_end|>"]

    agents, _, runner = _tool_runner(script)
    try:
        specs = [TrajectorySpec("slow", 0, TOK.encode("slow")), TrajectorySpec("fast", 1, TOK.encode("fast"))]
        result = asyncio.run(agents.run(specs, Sampling(max_tokens=600), needed=1))
        slow, fast = result.trajectories
        assert result.finished_groups == [1] and result.aborted == 1
        assert fast.finish_reason == "stop" and slow.finish_reason == "abort"
        assert slow.info["pending_tools"] and TOK.decode(slow.token_ids) == call("sleepy", seconds=3)
        again = asyncio.run(agents.run([TrajectorySpec("slow", 0, TOK.encode("slow"), resume=slow)],
                                       Sampling(max_tokens=600)))
        [t] = again.trajectories
        assert t.finish_reason == "stop" and t.info["tool_turns"] == 1 and t.info["assistant_turns"] == 2
        assert "woke up" in TOK.decode(t.token_ids) and TOK.decode(t.token_ids).endswith("done<|im_end|>")
    finally:
        runner.close()


def test_a_user_agent_named_in_the_job():
    agent = load_agent(f"{HERE / 'agents_for_tests.py'}:twice")
    runner = AgentRunner(Router([FakeAsyncEngine(lambda p: [4, 5])]), agent)
    result = asyncio.run(runner.run([TrajectorySpec("a", 0, [1])], Sampling(max_tokens=10)))
    [t] = result.trajectories
    assert (t.token_ids, t.loss_mask, t.logprobs) == ([4, 5, 7, 7, 4, 5], [1, 1, 0, 0, 1, 1],
                                                      [-0.25, -0.25, 0.0, 0.0, -0.25, -0.25])
    with pytest.raises(UserError, match="not an `async def`"):
        load_agent(f"{HERE / 'agents_for_tests.py'}:not_async")
    assert load_agent(None) is None


def test_an_agent_error_stops_the_call():
    async def bad(ctx):
        raise RuntimeError("agent bug")

    runner = AgentRunner(Router([FakeAsyncEngine(lambda p: [4])]), bad)
    with pytest.raises(RuntimeError, match="agent bug"):
        asyncio.run(runner.run([TrajectorySpec("a", 0, [1]), TrajectorySpec("b", 1, [1])], Sampling(max_tokens=4)))
    assert isinstance(tool_agent, object) and Trajectory().finish_reason == "stop"


QUICKSTART = "jobs/quickstart_cpu.toml"
SERVER = ["rollout.engine=vllm", "rollout.mode=server"]


@pytest.mark.parametrize("patch,key,fragment", [
    (["rollout.engine=sglang", "rollout.mode=server", "rollout.load_format=dummy"], "rollout.mode",
     "set rollout.engine = 'vllm' or 'hf'"),
    (["rollout.engine=hf", "rollout.mode=server", "rollout.tensor_parallel=2"], "rollout.tensor_parallel",
     "does not shard"),
    (["rollout.over_sample_rate=0.25"], "rollout.over_sample_rate", "needs rollout.mode = 'server'"),
    ([*SERVER, "rollout.over_sample_rate=0.25"], "rollout.max_staleness", "over-sampling carries"),
    ([*SERVER, "rollout.partial_rollout_tokens=2", "rollout.max_staleness=1"], "rollout.partial_rollout_tokens",
     "rollout.over_sample_rate instead"),
    ([*SERVER, "rollout.multi_turn.agent=x.py:f"], "rollout.multi_turn.agent", "rollout.multi_turn.enable"),
    ([*SERVER, "rollout.placement=separate", "rollout.ranks=1", "rollout.tensor_parallel=2", "platform.ranks_per_node=3"],
     "rollout.tensor_parallel", "one engine per rollout rank"),
    (["rollout.router=driver"], "rollout.router", "needs rollout.mode = 'server'"),
    ([*SERVER, "rollout.router=driver", 'reward.sources=[{name="rm",model_path="/nowhere/rm"}]', "reward.function=null"],
     "rollout.router", "a reward model (reward.model_path) runs on every rank"),
])
def test_validate_refuses_impossible_server_settings_in_one_line(patch, key, fragment):
    from mrl.config.loader import load
    from mrl.errors import SpecError

    with pytest.raises(SpecError) as e:
        load(QUICKSTART, patch)
    assert any(f": {key}: " in p and fragment in p and "\n" not in p for p in e.value.problems), e.value.problems


def test_validate_names_a_missing_agent_in_one_line():
    from mrl.config.loader import load
    from mrl.errors import SpecError

    base = [*SERVER, "rollout.multi_turn.enable=true"]
    with pytest.raises(SpecError) as e:
        load(QUICKSTART, [*base, "rollout.multi_turn.agent=tests/rollout/agents_for_tests.py:nowhere"])
    assert any(": rollout.multi_turn.agent: " in p and "nowhere" in p for p in e.value.problems), e.value.problems
    spec, _ = load(QUICKSTART, [*base, "rollout.multi_turn.agent=tests/rollout/agents_for_tests.py:twice"])
    assert spec.rollout.multi_turn.agent.endswith("agents_for_tests.py:twice")


def test_validate_accepts_server_mode_with_over_sampling():
    from mrl.config.loader import load

    spec, _ = load(QUICKSTART, [*SERVER, "rollout.over_sample_rate=0.25", "rollout.max_staleness=1"])
    assert spec.rollout.mode == "server" and spec.rollout.over_sample_rate == 0.25
    spec, _ = load(QUICKSTART, [*SERVER, "rollout.router=driver", "rollout.placement=separate", "rollout.ranks=2",
                                "platform.ranks_per_node=4"])
    assert spec.rollout.router == "driver"


def test_a_server_rollout_past_its_timeout_is_one_line_and_aborts_its_requests():
    from mrl.rollout.server import ServerRollout
    from mrl.rollout.vllm_async import LoopThread

    engine = FakeAsyncEngine(lambda p: list(range(1000)), tick=0.01)
    server = ServerRollout([engine], LoopThread(), AgentRunner(Router([engine]), single_turn), timeout_s=0.2)
    try:
        with pytest.raises(UserError, match="rollout.generate_timeout_s = 0.2 s"):
            server.generate([[1, 2]], Sampling(max_tokens=1000))
        assert server.generate([[1, 2]], Sampling(max_tokens=3))[0].token_ids == [0, 1, 2]   # still serving
    finally:
        server.shutdown()


@pytest.mark.parametrize("caps", [dict(max_assistant_turns=4), dict(max_user_turns=1), dict(max_tokens=150),
                                  dict(max_parallel_calls=2)])
def test_the_built_in_agent_gives_the_lockstep_loops_conversation(caps):
    """The same scripted policy and tools through `MultiTurnRollout` (lockstep) and `tool_agent`
    (one coroutine): the same token ids, loss masks, finish reason and turn/tool counts."""
    from mrl.rollout.multi_turn import MultiTurnRollout
    from tests.rollout.test_multi_turn import ScriptedEngine

    caps = dict(caps)
    max_tokens = caps.pop("max_tokens", 2000)
    script = [call("echo", text="a") + call("echo", text="b"), "<tool_call>{bad}</tool_call>", call("echo", text="c"),
              "done<|im_end|>"]
    refs = [f"{TOOLS}:echo"]
    prompt = TOK.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    lockstep = MultiTurnRollout(ScriptedEngine(script), TOK, ToolRunner(refs, 5.0), **caps)
    [want] = lockstep.generate([prompt], Sampling(max_tokens=max_tokens))
    lockstep.tools.close()

    def answer(ids):
        turn = TOK.decode(ids).count("</tool_response><|im_end|>")
        return TOK.encode(script[min(turn, len(script) - 1)])

    runner = ToolRunner(refs, 5.0)
    mt = SimpleNamespace(enable=True, max_assistant_turns=caps.get("max_assistant_turns"),
                         max_user_turns=caps.get("max_user_turns"), max_parallel_calls=caps.get("max_parallel_calls", 1),
                         max_tool_response_tokens=256, tool_response_truncate_side="middle")
    agents = AgentRunner(Router([FakeAsyncEngine(answer)]), tools=AsyncTools(runner), tokenizer=TOK, multi_turn=mt,
                         turns=TurnTemplate(TOK, runner.schemas()), format=HermesFormat())
    try:
        [got] = asyncio.run(agents.run([TrajectorySpec("t", 0, prompt)], Sampling(max_tokens=max_tokens))).trajectories
    finally:
        runner.close()
    from mrl.rollout.server import to_response

    got = to_response(0, got)
    assert TOK.decode(got.token_ids) == TOK.decode(want.token_ids)
    assert (got.token_ids, got.loss_mask, got.finish_reason) == (want.token_ids, want.loss_mask, want.finish_reason)
    assert got.info == want.info
    assert [lp == 0.0 for lp in got.logprobs] == [m == 0 for m in got.loss_mask]


def test_a_weight_update_pauses_generation_and_resumes_it():
    """`ServerRollout.update_weights` while a trajectory is generating: the engine is paused for the
    update (the request waits, is not aborted) and resumes; the request ends normally."""
    import threading

    from mrl.rollout.server import ServerRollout
    from mrl.rollout.vllm_async import LoopThread

    engines = [FakeAsyncEngine(lambda p: list(range(60)), tick=0.005, name=f"e{i}") for i in range(2)]
    server = ServerRollout(engines, LoopThread(), AgentRunner(Router(engines), single_turn))
    out = {}
    worker = threading.Thread(target=lambda: out.update(r=server.generate([[1, 2], [3, 4]], Sampling(max_tokens=60))))
    try:
        worker.start()
        time.sleep(0.05)
        assert server.update_weights(iter([("w", None), ("v", None)])) == 2
        worker.join(30)
        assert all(e.updated_while_paused and e.weights == 1 and e.paused.is_set() for e in engines)
        assert [r.token_ids for r in out["r"]] == [list(range(60))] * 2
        assert {r.finish_reason for r in out["r"]} == {"stop"}
    finally:
        server.shutdown()
