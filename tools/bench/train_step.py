"""Benchmark one actor update of the megatron training engine (random weights, synthetic rollouts).

Prints tokens/s, the step-time breakdown (packing, loss callback incl. the log-prob kernel,
optimizer step, model forward/backward = the rest), peak memory (CUDA allocator peak; host peak
RSS on cpu) and, on cuda, MFU (6 x params x tokens / time / peak bf16 FLOP/s; activation
recompute is not credited). Runs on one rank; start it directly or under torchrun.

    python tools/bench/train_step.py                                  # tiny model on cpu
    python tools/bench/train_step.py --shape 370m --device cuda        # ~370M Llama-shaped model
    python tools/bench/train_step.py --shape qwen2.5-1.5b --device cuda --micro-batch-tokens 8192
    python tools/bench/train_step.py --shape qwen2.5-7b --device cuda --recompute selective

`--json PATH` also writes the figures (shares of the step as fractions, MFU as a fraction or null
off CUDA) for tools/gpu/check.py.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time

import torch

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


class Timed:
    """Wraps a callable and accumulates its wall time."""

    def __init__(self, fn, sync):
        self.fn, self.sync, self.seconds = fn, sync, 0.0

    def __call__(self, *args, **kwargs):
        self.sync()
        t = time.perf_counter()
        out = self.fn(*args, **kwargs)
        self.sync()
        self.seconds += time.perf_counter() - t
        return out


# Random-weight shapes (Hugging Face config fields). The Qwen2.5 shapes are the published configs.
SHAPES = {
    "tiny": dict(model_type="llama", vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
                 tie_word_embeddings=False),
    # the SmolLM2 job's model (jobs/smollm2_chainsum_cpu.toml; tied embeddings): with --responses 32
    # --prompt-len 80 --response-len 32 one rank's share of that job's update
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True),
    "370m": dict(model_type="llama", vocab_size=32000, hidden_size=1024, intermediate_size=4096,
                 num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=4,
                 max_position_embeddings=32768, tie_word_embeddings=False),
    "qwen2.5-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         max_position_embeddings=32768, tie_word_embeddings=False),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       max_position_embeddings=32768, tie_word_embeddings=False),
}


def peak_memory_gib(cuda: bool) -> float:
    """CUDA allocator peak, or this process's peak resident set on the host."""
    if cuda:
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def synthetic_batch(vocab, responses, prompt_len, response_len, seed=0):
    from mrl.batch import Batch

    g = torch.Generator().manual_seed(seed)
    prompts, resps = [], []
    for i in range(responses):
        p = int(torch.randint(prompt_len // 2, prompt_len + 1, (1,), generator=g))
        r = int(torch.randint(response_len // 4, response_len + 1, (1,), generator=g))
        prompts.append(torch.randint(0, vocab, (p,), generator=g).tolist())
        resps.append(torch.randint(0, vocab, (r,), generator=g).tolist())
    b = Batch.from_sequences(prompts, resps, group_index=[i // 4 for i in range(responses)])
    lp = -torch.rand(len(b), b.response_width, generator=g) * 5
    return b.add(old_logprobs=lp, advantages=torch.randn(len(b), generator=g))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=list(SHAPES), default="tiny")
    ap.add_argument("--big", action="store_true", help="same as --shape 370m")
    ap.add_argument("--attention", default="auto", help="model.attention backend (auto, te, varlen, sdpa, flex)")
    ap.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                    help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--responses", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--response-len", type=int, default=None)
    ap.add_argument("--micro-batch-tokens", type=int, default=None)
    ap.add_argument("--full-head", action="store_true",
                    help="the LM head over the whole packed row (Engine(head_rows=False), the path before issue 41) "
                         "instead of the response positions only")
    ap.add_argument("--steps", type=int, default=3, help="measured steps (after one warm-up step)")
    ap.add_argument("--json", metavar="PATH", default=None,
                    help="also write the figures to PATH as JSON (the printed output is unchanged)")
    args = ap.parse_args()
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="29533").items():
        os.environ.setdefault(k, v)

    from mrl import platform
    from mrl.engine import Engine
    from mrl.engine.objectives import PolicyObjective
    from mrl.models.megatron import build_gpt, transformer_config
    from mrl.optim import build_optimizer, build_scheduler, guarded_step, wrap_ddp
    from mrl.optim.config import OptimConfig, ScheduleConfig
    from mrl.platform.config import ParallelConfig, PlatformConfig

    cuda = args.device == "cuda"
    responses = args.responses or (64 if cuda else 16)
    prompt_len = args.prompt_len or (512 if cuda else 64)
    response_len = args.response_len or (1024 if cuda else 128)
    budget = args.micro_batch_tokens or (16384 if cuda else 1024)
    parallel = ParallelConfig(distributed_optimizer=cuda)
    with platform.setup(PlatformConfig(device=args.device, nodes=1, ranks_per_node=1), parallel, seed=1) as ctx:
        hf = SHAPES["370m" if args.big else args.shape]
        dtype = args.dtype or ("bfloat16" if cuda else "float32")
        cfg = transformer_config(hf, dtype=dtype, parallel=parallel, device=args.device, recompute=args.recompute,
                                 attention=args.attention)
        model = build_gpt(hf, cfg, attention=args.attention)
        if cuda:
            model = model.cuda()
        params = sum(p.numel() for p in model.parameters())
        ddp = wrap_ddp([model], distributed_optimizer=parallel.distributed_optimizer, overlap_grad_reduce=False)
        optim = OptimConfig(lr=1e-6, grad_clip=1.0)
        opt = build_optimizer(ddp, optim, distributed_optimizer=parallel.distributed_optimizer)
        sched = build_scheduler(opt, optim, ScheduleConfig(), 100)
        engine = Engine(ddp, optimizer=opt, scheduler=sched, grad_clip=1.0, head_rows=not args.full_head)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        pack_t = Timed(engine.micro_batches, sync)
        engine.micro_batches = pack_t
        loss_t = Timed(PolicyObjective(eps_low=0.2, eps_high=0.28), sync)
        batch = synthetic_batch(hf["vocab_size"], responses, prompt_len, response_len)
        tokens = int(batch.sequence_lengths.sum())
        opt_s = total = 0.0
        for i in range(args.steps + 1):
            if i == 1:  # the first step warms up (allocations, lazy inits)
                pack_t.seconds = loss_t.seconds = 0.0
            sync()
            t0 = time.perf_counter()
            m = engine.forward_backward(batch, loss_t, micro_batch_tokens=budget)
            sync()
            t1 = time.perf_counter()
            guarded_step(opt, sched, loss=m["loss"], clip=1.0, policy="stop", where=f"bench step {i}")
            sync()
            t2 = time.perf_counter()
            if i >= 1:
                opt_s += t2 - t1
                total += t2 - t0
        n = args.steps
        step_s = total / n
        pack_s, loss_s, opt_step = pack_t.seconds / n, loss_t.seconds / n, opt_s / n
        math_s = step_s - pack_s - loss_s - opt_step
        print(f"train_step: {ctx.platform}, {args.shape if not args.big else '370m'} ({params / 1e6:.1f}M params, "
              f"{dtype}, attention {model.mrl_attention}, recompute {args.recompute}), {responses} responses, "
              f"{tokens} tokens/step, {int(m['micro_batches'])} micro-batch(es) of <= {budget} tokens, LM head at "
              f"{'every row position' if args.full_head else 'the response positions'}; last loss {m['loss']:.9g}")
        print(f"  step {step_s * 1e3:.1f} ms  ->  {tokens / step_s:,.0f} tokens/s")
        print(f"  packing {pack_s / step_s:6.2%}   loss callback (incl. log-prob kernel) {loss_s / step_s:6.2%}   "
              f"optimizer step {opt_step / step_s:6.2%}   model forward/backward {math_s / step_s:6.2%}")
        print(f"  outside model math (packing + loss + optimizer bookkeeping): "
              f"{(pack_s + loss_s + opt_step) / step_s:.2%}")
        print(f"  peak memory {peak_memory_gib(cuda):.2f} GiB ({'CUDA allocator' if cuda else 'host RSS'})")
        figures = dict(device=args.device, device_name="cpu", shape="370m" if args.big else args.shape,
                       params=params, dtype=dtype, attention=model.mrl_attention, recompute=args.recompute,
                       responses=responses, tokens_per_step=tokens, micro_batches=int(m["micro_batches"]),
                       micro_batch_tokens=budget, head_rows=not args.full_head, step_ms=step_s * 1e3,
                       tokens_per_s=tokens / step_s,
                       share_packing=pack_s / step_s, share_loss=loss_s / step_s,
                       share_optimizer=opt_step / step_s, share_model=math_s / step_s,
                       share_outside_model_math=(pack_s + loss_s + opt_step) / step_s,
                       peak_memory_gib=peak_memory_gib(cuda), model_tflops=None, peak_tflops=None, mfu=None)
        if cuda:
            name = torch.cuda.get_device_name()
            peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
            flops = 6 * params * tokens / step_s
            mfu = f"{flops / peak:.1%} of {peak / 1e12:.0f} TFLOP/s bf16" if peak else "peak unknown"
            print(f"  {name}: {flops / 1e12:.1f} TFLOP/s model math (6 x params x tokens), MFU {mfu}")
            figures.update(device_name=name, model_tflops=flops / 1e12, peak_tflops=peak / 1e12 if peak else None,
                           mfu=flops / peak if peak else None)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
