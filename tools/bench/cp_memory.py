"""Peak memory per rank of one actor forward/backward on a long packed micro-batch, with and
without context parallelism (CPU, gloo, 2 ranks).

    python tools/bench/cp_memory.py                    # 16384 tokens: CP1 (DP2) and CP2 (DP1)
    python tools/bench/cp_memory.py --tokens 32768 --layers 4
    python tools/bench/cp_memory.py --dtype bfloat16    # bf16 parameters and activations

Each run is `torchrun --nproc_per_node 2` of this file with `--worker`: a tiny Qwen2-shaped model
(`--hidden`, `--layers`, 8 heads / 2 KV heads, vocabulary 1024) and one response of `--tokens`
tokens (prompt 256), trained by the engine's PPO objective in one micro-batch. At CP1 both ranks
hold the whole sequence (DP2 with the batch on each); at CP2 each holds 2 of its 4 chunks. A rank
reports its process's peak resident memory (`ru_maxrss`) after the model is built and warmed up
on a short batch, and after the long step: the difference is what the long micro-batch costs.
Figures are printed, never asserted.
"""
from __future__ import annotations

import argparse
import resource
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(args) -> None:
    import torch

    from mrl.batch import Batch
    from mrl.engine import Engine
    from mrl.engine.objectives import PolicyObjective
    from mrl.optim import build_optimizer, wrap_ddp
    from mrl.optim.config import OptimConfig
    from mrl.models import tiny_model as tm
    from mrl.platform import setup, teardown
    from mrl.platform.config import ParallelConfig, PlatformConfig

    ctx = setup(PlatformConfig(device="cpu", nodes=1, ranks_per_node=2, collective_timeout_s=600),
                ParallelConfig(context=args.context), seed=1)
    spec = tm.TinyGPTSpec(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                          num_query_groups=2, ffn_hidden_size=2 * args.hidden, vocab_size=1024,
                          seq_length=args.tokens + 64)
    dtype = getattr(torch, args.dtype)
    config = tm.tiny_gpt_config(spec, params_dtype=dtype, bf16=dtype == torch.bfloat16)
    model = tm.build_tiny_gpt(spec, config=config)
    ddp = wrap_ddp([model], distributed_optimizer=False)
    eng = Engine(ddp, optimizer=build_optimizer(ddp, OptimConfig(lr=1e-5), distributed_optimizer=False))
    obj = PolicyObjective(loss="ppo")
    g = torch.Generator().manual_seed(0)

    def batch(response: int) -> Batch:
        prompt = torch.randint(0, 1024, (256,), generator=g).tolist()
        resp = torch.randint(0, 1024, (response,), generator=g).tolist()
        b = Batch.from_sequences([prompt], [resp])
        return b.add(advantages=torch.ones(1), old_logprobs=torch.full((1, response), -7.0))

    eng.forward_backward(batch(256), obj, micro_batch_tokens=args.tokens)      # warm-up: buffers, kernels
    before = _peak_mb()
    eng.forward_backward(batch(args.tokens - 256), obj, micro_batch_tokens=args.tokens)
    after = _peak_mb()
    peaks = [None, None]
    torch.distributed.all_gather_object(peaks, (before, after))
    if ctx.rank == 0:
        for r, (b, a) in enumerate(peaks):
            print(f"CP{args.context} {args.dtype} rank {r}: peak RSS {a:.0f} MB (after warm-up {b:.0f} MB; the {args.tokens}-token "
                  f"step adds {a - b:.0f} MB)", flush=True)
    teardown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--contexts", type=int, nargs="+", default=[1, 2])
    p.add_argument("--context", type=int, default=1)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--worker", action="store_true")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    sys.path.insert(0, str(REPO))
    from tests.dist_util import free_port, repo_pythonpath

    import os

    for cp in args.contexts:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), __file__, "--worker", "--context", str(cp), "--tokens",
               str(args.tokens), "--hidden", str(args.hidden), "--layers", str(args.layers), "--dtype", args.dtype]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo_pythonpath()}
        out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"CP{cp} failed:\n{out.stdout}\n{out.stderr[-4000:]}")
        print(out.stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
