"""Throughput of the non-function rewards, measured on this machine against local services.

    python tools/bench/rewards.py                 # all three, a few seconds each
    python tools/bench/rewards.py --only remote   # remote | judge | code

- remote: `RemoteScorer` against a local reward service (tests/reward/fake_services.py) at
  concurrency 1, 8 and 32, with `--batch-size` responses per request (1 shows the per-request
  cost; 16 is the default of `reward.remote.batch_size`); the service adds `--latency-ms` to each
  request, as a real verifier would.
- judge: `JudgeScorer` against a local fake chat-completions judge (concurrency 8), and the local
  judge on the builtin tiny model (CPU, 8 new tokens) on the hf engine and, where vllm is
  importable (.venv-vllm), on the vllm engine; `--judge-batch` responses per call.
- code: sandboxed test executions per second (`mrl.reward.code.run_case`, one stdio test per
  process), one at a time and through a `Rewarder` with `--workers` reward workers.
Prints one line per configuration: items/s.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mrl.reward.compose import Rewarder, RewardSample  # noqa: E402
from mrl.reward.config import CodeRewardConfig, JudgeConfig, RemoteRewardConfig, RewardConfig  # noqa: E402


def samples(n: int) -> list[RewardSample]:
    return [RewardSample(i, "Pick a number:", f"the answer is {i % 10}", str(i % 10)) for i in range(n)]


def bench_remote(args) -> None:
    from tests.reward.fake_services import serve

    server, url = serve("reward")
    server.handler.delay_s = args.latency_ms / 1000
    for concurrency in (1, 8, 32):
        cfg = RewardConfig(url=url, remote=RemoteRewardConfig(batch_size=args.batch_size, concurrency=concurrency))
        n = max(64, concurrency * args.batch_size * 4)
        with Rewarder.from_config(cfg) as r:
            r.score(samples(8))   # warm up
            t = time.perf_counter()
            res = r.score(samples(n))
            dt = time.perf_counter() - t
        assert not res.errors, res.errors[:1]
        print(f"remote  concurrency {concurrency:2d} batch {args.batch_size:2d} latency {args.latency_ms:g} ms: "
              f"{n / dt:8.1f} rewards/s")
    server.shutdown()


def bench_judge(args) -> None:
    from tests.reward.fake_services import serve

    server, url = serve("judge")
    server.handler.delay_s = args.latency_ms / 1000
    cfg = RewardConfig(judge=JudgeConfig(url=url + "/v1/chat/completions"), remote=RemoteRewardConfig(concurrency=8))
    with Rewarder.from_config(cfg) as r:
        t = time.perf_counter()
        r.score(samples(256))
        print(f"judge   http fake (concurrency 8, latency {args.latency_ms:g} ms): {256 / (time.perf_counter() - t):8.1f} rewards/s")
    server.shutdown()
    from mrl.rollout.vllm_engine import vllm_available

    engines = ("hf", "vllm") if vllm_available() else ("hf",)
    for engine in engines:
        extra = {"engine_kwargs": {"enforce_eager": True}} if engine == "vllm" else {}
        cfg = RewardConfig(judge=JudgeConfig(model="builtin:tiny-qwen2", max_tokens=8, engine=engine, **extra))
        t = time.perf_counter()
        with Rewarder.from_config(cfg) as r:
            start = time.perf_counter() - t
            r.score(samples(8))
            t = time.perf_counter()
            r.score(samples(args.judge_batch))
            dt = time.perf_counter() - t
        print(f"judge   local tiny-qwen2 on the {engine} engine, CPU ({args.judge_batch} responses, 8 new tokens, "
              f"engine start {start:.1f} s): {args.judge_batch / dt:8.1f} rewards/s")


def bench_code(args) -> None:
    from mrl.reward.code import run_case
    from mrl.reward.code_sandbox import Limits, isolation_mode

    program = "a, b = map(int, input().split())\nprint(a + b)"
    case = {"kind": "stdio", "input": "1 2\n", "expected": "3\n"}
    for isolation in ("auto", "rlimits"):
        mode = isolation_mode(isolation)
        run_case(program, case, Limits(), isolation)
        t, n = time.perf_counter(), 40
        results = [run_case(program, case, Limits(), isolation) for _ in range(n)]
        assert results == ["passed"] * n, results
        print(f"code    one at a time, isolation {mode:14s}: {n / (time.perf_counter() - t):8.1f} executions/s")
    tests = json.dumps({"inputs": ["1 2\n"] * 8, "outputs": ["3\n"] * 8})
    response = f"```python\n{program}\n```"
    cfg = RewardConfig(builtin="code", workers=args.workers, code=CodeRewardConfig())
    with Rewarder.from_config(cfg) as r:
        r.score([RewardSample(0, "q", response, tests)])
        t = time.perf_counter()
        res = r.score([RewardSample(i, "q", response, tests) for i in range(16)])
        dt = time.perf_counter() - t
    assert res.scores == [1.0] * 16
    print(f"code    Rewarder, {args.workers} workers, 8 tests/response:   {16 * 8 / dt:8.1f} executions/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=("remote", "judge", "code"))
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--latency-ms", type=float, default=0.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--judge-batch", type=int, default=64, help="responses per call of the local judge")
    args = p.parse_args()
    for name, fn in (("remote", bench_remote), ("judge", bench_judge), ("code", bench_code)):
        if args.only in (None, name):
            fn(args)


if __name__ == "__main__":
    main()
