"""Benchmark the weight-sync checksums, before and after, side by side in one run.

    python tools/bench/checksum.py                       # SmolLM2-135M's tensors in bf16, 3 repeats
    python tools/bench/checksum.py --dtype float32 --repeat 5 --json out.json

Hashes every tensor of a model of SmolLM2-135M-Instruct's shape (the SmolLM2 job's model: 30
layers, hidden 576, 272 tensors, 269 MB in bf16; random values, which a checksum does not care
about) with:

- `before`: the checksum this replaced (every 32-bit word widened to int64, an int64 position
  vector, a product and two sums: about five passes over eight times the bytes), kept here only
  to be measured;
- `xxh3`: what `mrl.weights.verify.checksum` computes in host memory (XXH3-128 over a zero-copy
  view of the bytes);
- `wsum32`: the device algorithm computed on the CPU with torch (what a host-side check of a GPU
  sender's checksum costs), and on CUDA with the Triton kernel when a GPU is present;
- `before (cuda)` on CUDA too when a GPU is present;
- `wsum32 batched (cuda)`: the same sums as a sync computes them, `checksum_many` over each
  bucket (512 MiB, `rollout.weight_sync.bucket_mb`'s default: the whole model here), one kernel
  launch and one host read per bucket, beside `wsum32 (cuda)`'s one of each per tensor.

Prints, per algorithm, the best time over `--repeat` runs, the hash rate in GB/s and the speedup
over `before`, then the cost at the 7B shape in `mrl plan` terms: the bytes of one full and one
delta sync of jobs/grpo_qwen2.5_7b.toml divided by each rate, against the link time `mrl plan`
prints for that sync. A colocated sync hashes what it sends once (the receiver does not rehash the
sender's own tensors); a separate-placement sync hashes it twice (sender and receiver). The load
average is printed with the figures: on a shared machine the rates move with it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

# SmolLM2-135M-Instruct's config.json (the values that size its tensors)
SMOLLM2 = {"model_type": "llama", "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
           "intermediate_size": 1536, "num_hidden_layers": 30, "vocab_size": 49152, "tie_word_embeddings": True}
JOB_7B = "jobs/grpo_qwen2.5_7b.toml"
BUCKET_BYTES = 512 * 2**20   # rollout.weight_sync.bucket_mb's default


def before_checksum(t: torch.Tensor) -> tuple[int, int, int]:
    """The replaced checksum (mrl.weights.verify before this bench): int64-widened word sums."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
    total, weighted = 0, 0
    for start in range(0, words.numel(), 1 << 24):
        chunk = words[start:start + (1 << 24)].to(torch.int64)
        pos = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=chunk.device) % 65521 + 1
        total += int(chunk.sum())
        weighted += int((chunk * pos).sum())
    mask = (1 << 64) - 1
    return total & mask, weighted & mask, t.numel() * t.element_size()


def model_tensors(cfg: dict, dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    from mrl.weights.sync_plan import hf_tensors

    g = torch.Generator().manual_seed(0)
    return [torch.randn(t.numel, generator=g).to(dtype).to(device) for t in hf_tensors(cfg)]


def buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """`tensors` cut as `WeightSender` cuts a sync into buckets of at most `bucket_bytes`."""
    out, size = [[]], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if out[-1] and size + n > bucket_bytes:
            out, size = out + [[]], 0
        out[-1].append(t)
        size += n
    return out


def best_seconds(fn, tensors: list[torch.Tensor], repeat: int, batched: bool = False,
                 bucket_bytes: int = BUCKET_BYTES) -> float:
    """Best time over `repeat` runs of `fn` over every tensor (`batched`: over each bucket's list)."""
    cuda = tensors[0].is_cuda
    work = buckets(tensors, bucket_bytes) if batched else tensors
    fn(work[0])   # warm-up (kernel compilation, lazy imports)
    best = float("inf")
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for t in work:
            fn(t)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def plan_7b(dtype: str) -> dict:
    from mrl.config.loader import load
    from mrl.weights.sync_plan import plan_sync

    spec, _ = load(str(REPO / JOB_7B), [f"rollout.weight_sync.dtype={dtype}"])
    plan = plan_sync(spec)
    return {"full_bytes": plan.full_bytes, "delta_bytes": plan.delta_bytes, "seconds_full": plan.seconds_full,
            "seconds_delta": plan.seconds_delta, "changed_fraction": plan.changed_fraction}


def run(dtype_name: str, repeat: int, cfg: dict = SMOLLM2, device: str | None = None) -> dict:
    """`device`: "cuda" adds the CUDA rows (the default when a GPU is present), "cpu" leaves them out."""
    from mrl.weights.verify import checksum, checksum_many

    dtype = getattr(torch, dtype_name)
    many = lambda ts: checksum_many([(t,) for t in ts], algorithm="wsum32")   # noqa: E731
    cases = [("before", "cpu", before_checksum, False),
             ("xxh3", "cpu", lambda t: checksum(t, algorithm="xxh3"), False),
             ("wsum32 (torch)", "cpu", lambda t: checksum(t, algorithm="wsum32"), False)]
    if (device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda":
        cases += [("before (cuda)", "cuda", before_checksum, False),
                  ("wsum32 (cuda)", "cuda", lambda t: checksum(t, algorithm="wsum32"), False),
                  ("wsum32 batched (cuda)", "cuda", many, True)]
    out = {"model": "SmolLM2-135M" if cfg is SMOLLM2 else "a small model", "dtype": dtype_name, "repeat": repeat, "load_average": os.getloadavg(), "cases": {}}
    tensors = {}
    for name, device, fn, batched in cases:
        if device not in tensors:
            tensors[device] = model_tensors(cfg, dtype, device)
        ts = tensors[device]
        nbytes = sum(t.numel() * t.element_size() for t in ts)
        seconds = best_seconds(fn, ts, repeat, batched)
        out["cases"][name] = {"seconds": seconds, "bytes": nbytes, "gbps": nbytes / seconds / 1e9,
                              "tensors": len(ts), "launches": len(buckets(ts, BUCKET_BYTES)) if batched else len(ts)}
    out["plan_7b"] = plan_7b(dtype_name)
    out["load_average_after"] = os.getloadavg()
    return out


def report(r: dict) -> str:
    cases = r["cases"]
    base = cases["before"]["seconds"]
    first = next(iter(cases.values()))
    lines = [f"checksums over {r['model']}'s {first['tensors']} tensors, {r['dtype']}, "
             f"{first['bytes'] / 1e6:.0f} MB; best of {r['repeat']}; "
             f"load average {r['load_average'][0]:.2f} (after: {r['load_average_after'][0]:.2f})",
             f"  {'algorithm':<22} {'seconds':>9} {'GB/s':>8} {'vs before':>10} {'launches':>9}"]
    for name, c in cases.items():
        ref = cases["before (cuda)"]["seconds"] if name.endswith("(cuda)") else base
        lines.append(f"  {name:<22} {c['seconds']:>9.4f} {c['gbps']:>8.2f} {ref / c['seconds']:>9.1f}x "
                     f"{c.get('launches', c['tensors']):>9}")
    if "wsum32 batched (cuda)" in cases:
        per, batched = cases["wsum32 (cuda)"]["seconds"], cases["wsum32 batched (cuda)"]["seconds"]
        lines.append(f"  wsum32 on CUDA, per tensor / batched per bucket: {per / batched:.1f}x "
                     f"({per / cases['wsum32 (cuda)']['tensors'] * 1e6:.0f} us per tensor vs "
                     f"{batched / cases['wsum32 batched (cuda)']['launches'] * 1e3:.2f} ms per bucket)")
    p = r["plan_7b"]
    lines.append(f"at the 7B shape ({JOB_7B}, `mrl plan` link time only): full sync {p['full_bytes'] / 1e9:.2f} GB "
                 f"in {p['seconds_full']:.3f} s, delta ({p['changed_fraction']:.0%} changed) "
                 f"{p['delta_bytes'] / 1e9:.2f} GB in {p['seconds_delta']:.3f} s")
    lines.append(f"  {'algorithm':<22} {'full: hash s':>13} {'/ link s':>9} {'delta: hash s':>14} {'/ link s':>9}")
    for name, c in cases.items():
        full_s, delta_s = p["full_bytes"] / (c["gbps"] * 1e9), p["delta_bytes"] / (c["gbps"] * 1e9)
        lines.append(f"  {name:<22} {full_s:>13.4f} {full_s / p['seconds_full']:>8.2f}x {delta_s:>14.4f} "
                     f"{delta_s / p['seconds_delta']:>8.3f}x")
    lines.append("  (one hash of what a colocated sync sends; separate placement hashes it twice, sender and receiver)")
    if not any(n.endswith("(cuda)") for n in cases):
        lines.append("  no CUDA device here: the GPU rows (the Triton wsum32 kernel, where a GPU sender hashes) "
                     "are not measured")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--device", choices=["cpu", "cuda"], help="cuda: also the CUDA rows (default: when a GPU is present)")
    args = ap.parse_args(argv)
    r = run(args.dtype, args.repeat, device=args.device)
    print(report(r))
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
