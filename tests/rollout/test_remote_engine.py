"""The cross-process engine channel (`mrl.rollout.remote`): a leader's engine served on its own
event loop, driven from another loop (standing in for another process) through `RemoteEngine`:
results arrive exactly (ids, log-probs, finish reasons), a batch keeps its order, a router
spreads and sticks over a local and a remote engine, aborts (running, early, by cancellation)
reach the leader's engine, pause holds it, errors and a wrong token are errors naming the leader.
The two-process run with the hf engine is `tests/train/test_driver_router.py`."""
from __future__ import annotations

import asyncio

import pytest

from mrl.rollout.async_engine import GenRequest
from mrl.rollout.remote import EngineServer, RemoteEngine, RemoteEngineError
from mrl.rollout.router import Router
from mrl.rollout.types import Sampling
from mrl.rollout.vllm_async import LoopThread
from tests.rollout.fake_async import FakeAsyncEngine


def _answer(prompt):
    return [t + 100 for t in prompt[:3]] + [7]


@pytest.fixture
def leader():
    """A fake engine served on a loop of its own; yields (engine, server, a client on another loop, that loop)."""
    there, here = LoopThread("leader"), LoopThread("driver")
    engine = FakeAsyncEngine(_answer, tick=0.002, name="remote")
    server = EngineServer(engine, token="secret")
    url = there.run(server.start(), timeout=30)
    client = RemoteEngine(url, "secret", "leader 1", timeout_s=60)
    yield engine, server, client, here
    here.run(client.close(), timeout=30)
    there.run(server.stop(), timeout=30)
    here.close()
    there.close()


def _req(i, prompt, max_tokens=16, seed=None):
    return GenRequest(f"t{i}-0", tuple(prompt), Sampling(n=1, temperature=1.0, max_tokens=max_tokens), seed=seed)


def test_results_arrive_exactly_and_a_batch_keeps_its_order(leader):
    engine, server, client, here = leader

    async def go():
        return await asyncio.gather(*(client.generate(_req(i, [1, 2 + i, 3], seed=11 + i)) for i in range(4)))

    out = here.run(go(), timeout=60)
    assert [r.request_id for r in out] == [f"t{i}-0" for i in range(4)]
    assert [r.token_ids for r in out] == [[101, 102 + i, 103, 7] for i in range(4)]
    assert all(r.logprobs == [-0.25] * 4 and r.finish_reason == "stop" for r in out)
    # one batch, in the order submitted; the engine saw prefixed ids, the sampling and the seeds sent
    assert server.log.received == [f"t{i}-0" for i in range(4)]
    assert [r.request_id for _, r in engine.served] == [f"remote:t{i}-0" for i in range(4)]
    assert [r.seed for _, r in engine.served] == [11, 12, 13, 14]
    assert engine.served[0][1].sampling == Sampling(n=1, temperature=1.0, max_tokens=16)


def test_a_router_spreads_and_sticks_over_a_local_and_a_remote_engine(leader):
    remote_engine, server, client, here = leader
    local = FakeAsyncEngine(_answer, tick=0.002, name="local")
    router = Router([local])
    assert router.add(client) == 1

    async def trajectory(i):   # two turns each
        a = await router.generate(f"t{i}", _req(i, [1, i]))
        b = await router.generate(f"t{i}", GenRequest(f"t{i}-1", (1, i, *a.token_ids), _req(i, [1]).sampling))
        return a, b

    async def go():
        return await asyncio.gather(*(trajectory(i) for i in range(4)))

    here.run(go(), timeout=60)
    # least outstanding work, ties to the lower index: t0 local, t1 remote, t2 local, t3 remote; later
    # turns stick (in the order their first turns finished)
    served = [r.request_id for _, r in local.served]
    assert served[:2] == ["t0-0", "t2-0"] and sorted(served[2:]) == ["t0-1", "t2-1"]
    assert server.log.received[:2] == ["t1-0", "t3-0"] and sorted(server.log.received[2:]) == ["t1-1", "t3-1"]


def test_an_abort_reaches_the_remote_leader(leader):
    engine, server, client, here = leader
    engine.answer = lambda p: list(range(10, 400))   # long: runs until aborted
    router = Router([FakeAsyncEngine(_answer, name="local"), client])

    async def go():
        router.pick("busy")   # the local engine takes the first trajectory...
        router.loads[0].outstanding += 1000   # ...and is the busier one while "far" is placed
        far = asyncio.ensure_future(router.generate("far", _req(9, [1, 2], max_tokens=300)))
        while engine.served == [] or server.log.received != ["t9-0"]:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        await router.abort(["far"])
        out = await far
        late = await router.generate("far", _req(10, [1], max_tokens=5))   # aborted trajectory: no request
        return out, late

    out, late = here.run(go(), timeout=60)
    assert router.sticky["far"] == 1
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 300
    assert out.token_ids == list(range(10, 10 + len(out.token_ids)))
    assert server.log.aborted == ["t9-0"]
    assert late.finish_reason == "abort" and late.token_ids == [] and server.log.received == ["t9-0"]


def test_early_abort_cancellation_and_pause(leader):
    engine, server, client, here = leader
    engine.answer = lambda p: list(range(10, 400))

    async def go():
        await client.abort(["t1-0"])          # aborted before it arrives: returns at once, no tokens
        early = await client.generate(_req(1, [5], max_tokens=300))
        task = asyncio.ensure_future(client.generate(_req(2, [5], max_tokens=300)))
        while "remote:t2-0" not in {r.request_id for _, r in engine.served}:
            await asyncio.sleep(0.01)
        task.cancel()                          # the caller went away: the leader stops it too
        for _ in range(500):
            if "remote:t2-0" in engine.stop:
                break
            await asyncio.sleep(0.01)
        await client.pause()
        paused = not engine.paused.is_set()
        await client.resume()
        return early, paused

    early, paused = here.run(go(), timeout=60)
    assert early.finish_reason == "abort" and early.token_ids == []
    assert "remote:t1-0" not in {r.request_id for _, r in engine.served}
    assert "remote:t2-0" in engine.stop
    assert paused and engine.paused.is_set()


def test_errors_name_the_leader(leader):
    engine, server, client, here = leader

    def broken(prompt):
        raise ValueError("engine exploded")

    engine.answer = broken
    with pytest.raises(RemoteEngineError, match=r"leader 1: request t0-0: ValueError: engine exploded"):
        here.run(client.generate(_req(0, [1])), timeout=60)
    stranger = RemoteEngine(client.url, "guess", "leader 1", timeout_s=60)
    with pytest.raises(RemoteEngineError, match=r"leader 1 \(http://127.0.0.1:\d+\) answered 403"):
        here.run(stranger.generate(_req(1, [1])), timeout=60)
    here.run(stranger.close(), timeout=30)
    assert server.log.received == ["t0-0"]
