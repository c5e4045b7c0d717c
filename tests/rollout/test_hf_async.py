"""The hf server-mode engine (`HFAsyncEngine`): greedy requests give the SPMD hf engine's tokens,
admission follows max_num_seqs and the step's prompt budget, abort cuts a request where it is,
pause holds the scheduler, and a budgeted run (over-sampling) is the same every time."""
from __future__ import annotations

import asyncio

import pytest
import torch

from mrl.rollout.agent_loop import AgentRunner, TrajectorySpec, single_turn
from mrl.rollout.async_engine import GenRequest
from mrl.rollout.hf import HFEngine
from mrl.rollout.hf_async import HFAsyncEngine
from mrl.rollout.router import Router
from mrl.rollout.types import Sampling

PROMPTS = [[1, 5, 6, 7, 8], [1, 9], [1, 300, 301]]


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return HFEngine.from_pretrained(tiny_model_dir, dtype="float32", seed=0)


def _requests(prompts, max_tokens, seed=None, temperature=0.0):
    s = Sampling(n=1, temperature=temperature, max_tokens=max_tokens)
    return [GenRequest(f"r{i}", tuple(p), s, seed=None if seed is None else seed + i) for i, p in enumerate(prompts)]


async def _all(engine, requests):
    return await asyncio.gather(*(engine.generate(r) for r in requests))


def test_greedy_requests_give_the_hf_engines_tokens_and_logprobs(hf):
    """Advanced 3 tokens per step (the prompt plus the tokens so far re-fed each step), a greedy
    request gives the tokens of one 10-token `HFEngine.generate` call, log-probs within 1e-5."""
    engine = HFAsyncEngine(hf, tick_tokens=3)
    out = asyncio.run(_all(engine, _requests(PROMPTS, 10)))
    want = hf.generate(PROMPTS, Sampling(n=1, temperature=0.0, max_tokens=10))
    for got, ref in zip(out, want):
        assert got.token_ids == ref.token_ids and got.finish_reason == ref.finish_reason == "length"
        assert max(abs(a - b) for a, b in zip(got.logprobs, ref.logprobs)) < 1e-5
    assert engine.steps == 4   # ceil(10 / 3) steps, all three requests in each


def test_admission_follows_max_num_seqs_and_the_prompt_budget(hf):
    """max_num_seqs 2: the third request starts when a slot frees; a 4-token prompt budget admits
    the 5-token prompt alone in the first step (always one when nothing runs), then the others."""
    engine = HFAsyncEngine(hf, tick_tokens=4, max_num_seqs=2)
    reqs = _requests(PROMPTS, 4)
    asyncio.run(_all(engine, reqs))
    assert engine.steps == 2   # [r0, r1] then [r2]

    seen = []
    engine = HFAsyncEngine(hf, tick_tokens=2, max_num_batched_tokens=4)
    step = engine._step

    def record():
        seen.append([r.request.request_id for r in engine.running])
        step()

    engine._step = record
    asyncio.run(_all(engine, _requests(PROMPTS, 4)))
    assert seen == [["r0"], ["r0", "r1"], ["r1", "r2"], ["r2"]]


def test_seeded_sampling_does_not_depend_on_the_batch(hf):
    """A seeded request samples the same tokens alone or beside others, in any step size' batch."""
    alone = [asyncio.run(_all(HFAsyncEngine(hf, tick_tokens=4), [r]))[0]
             for r in _requests(PROMPTS, 8, seed=11, temperature=1.0)]
    together = asyncio.run(_all(HFAsyncEngine(hf, tick_tokens=4, max_num_seqs=2),
                                _requests(PROMPTS, 8, seed=11, temperature=1.0)))
    assert [r.token_ids for r in alone] == [r.token_ids for r in together]
    assert all(len(r.token_ids) == 8 or r.finish_reason == "stop" for r in together)


def test_abort_and_pause(hf):
    async def scenario():
        engine = HFAsyncEngine(hf, tick_tokens=2)
        r0, r1 = _requests(PROMPTS[:2], 12)
        t0 = asyncio.ensure_future(engine.generate(r0))
        t1 = asyncio.ensure_future(engine.generate(r1))
        while engine.steps < 2:
            await asyncio.sleep(0)
        await engine.abort(["r0"])
        first = await t0
        assert first.finish_reason == "abort" and len(first.token_ids) == 4 == len(first.logprobs)
        await engine.pause()
        held = engine.steps
        for _ in range(20):
            await asyncio.sleep(0)
        assert engine.steps == held and not t1.done()   # paused: no step runs, the request waits
        loaded = engine.update_weights([("lm_head.weight", hf.model.lm_head.weight.detach().clone())], partial=True)
        await engine.resume()
        second = await t1
        assert loaded == 1 and engine.version == 1
        assert second.finish_reason == "length" and len(second.token_ids) == 12 and second.weight_version == 0

    asyncio.run(scenario())


def test_a_budgeted_run_is_the_same_every_time(hf):
    """Over-sampling on the hf server engine: 5 groups of 2 for a need of 3, up to 4 running, one
    3-token prompt admitted per step (so requests are at different points when the need is met);
    the groups that finish, the trajectories aborted and their tokens are the same in two runs,
    and some aborted trajectory holds tokens (a partial rollout)."""
    prompts = [[1, 5 + g, 6] for g in range(5)]

    def run():
        engine = HFAsyncEngine(hf, tick_tokens=3, max_num_seqs=4, max_num_batched_tokens=3)
        specs = [TrajectorySpec(f"g{g}r{j}", g, p, seed=100 * g + j) for g, p in enumerate(prompts) for j in range(2)]
        result = asyncio.run(AgentRunner(Router([engine]), single_turn).run(
            specs, Sampling(n=1, temperature=1.0, max_tokens=9), needed=3))
        return result, [(t.token_ids, t.logprobs, t.finish_reason) for t in result.trajectories]

    (a, ta), (b, tb) = run(), run()
    assert ta == tb and a.finished_groups == b.finished_groups and a.aborted == b.aborted
    assert len(a.finished_groups) == 3 and a.aborted > 0
    assert any(t.finish_reason == "abort" and t.token_ids for t in a.trajectories)
    assert torch.tensor([len(t.token_ids) for t in a.trajectories]).max() <= 9
