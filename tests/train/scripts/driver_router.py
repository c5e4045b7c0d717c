"""One router over two engine groups whose leaders are two processes (`rollout.router = "driver"`),
with the hf server engine; run by `tests/train/test_driver_router.py` on 2 ranks (torchrun, gloo).

    python driver_router.py OUT_DIR

Part 1, per dtype (float32, bfloat16), on a tiny random Llama both ranks load: rank 1 serves its
`HFAsyncEngine` over the channel, rank 0's `ServerRollout` routes over its own engine and rank
1's. Checked on rank 0:
- 8 single-turn trajectories spread over both leaders (least outstanding work: every other one
  to rank 1) and give exactly the tokens, log-probs and finish reasons of the same router over two
  engines in rank 0's process (same seeds);
- a two-turn agent's turns stay on their trajectory's engine (sticky);
- an abort of a trajectory generating on rank 1 reaches rank 1's engine, which returns the tokens
  it had.
Prints `PART1 <dtype> ok <remote served> <remote aborted>` per dtype.

Part 2: `mrl train` (jobs/quickstart_cpu.toml, DP 2 of 1 rank, server mode, hf engine), one run per
override set given (the test's: rollout.router = "leader" and "driver", same seeds; a leader run
with over-sampling and a run from its step-2 checkpoint); prints `RESULT <index> <metrics json>`
per run.
"""
from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from tests.dist_util import print_result

SPECS = 8


def _server_rollout(path: str, dtype: str, agent=None):
    from mrl.rollout.agent_loop import AgentRunner
    from mrl.rollout.hf import HFEngine
    from mrl.rollout.hf_async import HFAsyncEngine
    from mrl.rollout.router import Router
    from mrl.rollout.server import ServerRollout
    from mrl.rollout.vllm_async import LoopThread

    engine = HFAsyncEngine(HFEngine.from_pretrained(path, dtype=dtype, seed=0), max_num_seqs=16)
    return ServerRollout([engine], LoopThread(), AgentRunner(Router([engine]), agent))


async def _two_turns(ctx):
    t = ctx.trajectory
    for _ in range(2):
        half = replace(ctx.sampling, max_tokens=4)
        out = await ctx.generate(list(ctx.prompt_ids) + t.token_ids, half)
        t.add(out.token_ids, out.logprobs, 1)
    t.finish_reason = "length"
    return t


def _specs(prefix: str):
    from mrl.rollout.agent_loop import TrajectorySpec

    return [TrajectorySpec(f"{prefix}{i}", i // 2, [1, 5 + i, 9, 40 + 3 * i], seed=1000 + i) for i in range(SPECS)]


def part1(out: Path, dtype: str) -> None:
    from mrl.rollout.async_engine import GenRequest
    from mrl.rollout.remote import RemoteEngine
    from mrl.rollout.types import Sampling
    from tests.rollout.conftest import save_tiny_model

    rank = dist.get_rank()
    path = out / "tiny"
    if rank == 0 and not path.exists():
        save_tiny_model(path)
    dist.barrier()
    sampling = Sampling(n=1, temperature=1.0, max_tokens=12)
    mine = _server_rollout(str(path), dtype)
    url = None
    token = [f"token-{os.getpid()}" if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    if rank == 1:
        url = mine.serve(token[0])
    urls = [None, None]
    dist.all_gather_object(urls, url)
    served = None
    if rank == 0:
        remote = RemoteEngine(urls[1], token[0], "the engine of rank 1", timeout_s=300)
        mine.route_to([remote])
        got = mine.run_groups(_specs("a"), sampling).trajectories
        # the same router over two engines in this process
        both = _server_rollout(str(path), dtype)
        other = _server_rollout(str(path), dtype)
        both.router.add(other.engines[0])
        want = both.run_groups(_specs("a"), sampling).trajectories
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.token_ids == w.token_ids, (dtype, i, g.token_ids, w.token_ids)
            assert g.logprobs == w.logprobs, (dtype, i, g.logprobs, w.logprobs)
            assert g.finish_reason == w.finish_reason and g.loss_mask == w.loss_mask == [1] * len(g.token_ids)
        assert len({tuple(t.token_ids) for t in got}) == SPECS, "every trajectory samples from its own seed"
        # sticky: a two-turn agent over the same router
        mine.runner.agent = _two_turns
        turns = mine.run_groups(_specs("b"), sampling).trajectories
        assert all(len(t.token_ids) == 8 for t in turns)
        # abort: rank 0's engine is the busier when "far" is placed, so rank 1 runs it; long enough to be cut
        router = mine.router

        async def abort_one():
            router.loads[0].outstanding += 10**6
            long = Sampling(n=1, temperature=1.0, max_tokens=400, ignore_eos=True)
            far = asyncio.ensure_future(router.generate("far", GenRequest("far-0", (1, 7, 7), long, seed=5)))
            while "far-0" not in router.loads[1].requests:   # placed on rank 1's engine
                await asyncio.sleep(0.001)
            # 400 tokens take this tiny model >= ~0.3 s on an idle core: 20 ms in, the abort lands mid-request
            # (an abort that overtakes the request still ends it as "abort": remote.py's early aborts)
            await asyncio.sleep(0.02)
            await router.abort(["far"])
            res = await far
            router.loads[0].outstanding -= 10**6
            return res, router.sticky.get("far")

        res, where = mine.loop.run(abort_one(), timeout=300)
        assert where == 1 and res.finish_reason == "abort" and len(res.token_ids) < 400, (where, res.finish_reason,
                                                                                          len(res.token_ids))
        both.shutdown()
        other.shutdown()
        dist.barrier()   # rank 1 reports what its channel served
        served = [None, None]
        dist.all_gather_object(served, None)
        log = served[1]
        assert log["received"][:SPECS // 2] == [f"a{i}-0" for i in range(1, SPECS, 2)], log   # every other one
        assert sorted(log["received"][SPECS // 2:SPECS // 2 + SPECS]) == sorted(
            [f"b{i}-{k}" for i in range(1, SPECS, 2) for k in (0, 1)]), log   # both turns of its trajectories
        assert log["aborted"] == ["far-0"] and log["received"][-1] == "far-0", log
        print(f"PART1 {dtype} ok: rank 1 served {len(log['received'])} requests; the abort cut 'far' at "
              f"{len(res.token_ids)} tokens", flush=True)
    else:
        dist.barrier()
        served = [None, None]
        dist.all_gather_object(served, {"received": mine.server.log.received, "aborted": mine.server.log.aborted})
    if rank == 0:   # the driver closes its channel first: rank 1's server then stops with no connection open
        mine.shutdown()
    dist.barrier()
    if rank == 1:
        mine.shutdown()


def part2(out: Path, runs: list[str]) -> None:
    from mrl.config.loader import load
    from mrl.tracking.startup import STARTUP
    from mrl.train.loop import train

    for i, overrides in enumerate(runs):
        STARTUP.start()   # its lines, as `mrl train` prints them (rank 0)
        spec, _ = load("jobs/quickstart_cpu.toml", [f"job.output_dir={out}", f"job.name=run{i}", *overrides.split()])
        metrics = train(spec)
        print_result(i, metrics)


def main() -> None:
    out = Path(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    # part 1's group on torchrun's own store (its agent hosts it), under a prefix of its own: mrl train's
    # later inits use theirs
    import datetime

    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                         timeout=datetime.timedelta(seconds=120), multi_tenant=True)
    dist.init_process_group("gloo", store=dist.PrefixStore("driver-router-part1", base), rank=rank, world_size=world)
    for dtype in ("float32", "bfloat16"):
        part1(out, dtype)
    dist.destroy_process_group()
    part2(out, sys.argv[2:])


if __name__ == "__main__":
    main()
