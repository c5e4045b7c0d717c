"""Benchmark the weight export (Megatron shards -> streamed, HF-named full tensors).

    python tools/bench/weights.py                          # 1 process, ~300M-param model, fp32
    python tools/bench/weights.py --dtype bf16             # cast on export (rollout engines in bf16)
    torchrun --nproc_per_node 2 tools/bench/weights.py --tp 2   # TP all-gather included (gloo on cpu)
    python tools/bench/weights.py --device cuda            # on a GPU machine (nccl under torchrun)

Builds a Qwen2-shaped model with random weights, then times, side by side in one run:
- export: `Exporter(...).stream()` (TP gather, QKV/gate-up split, vocab trim, cast), every tensor
  consumed as it streams, optionally packed into `--bucket-mb` buckets;
- copy: a plain `torch.cat` of the same parameters into one flat buffer (the floor any export
  must pay to produce the same bytes once).
Prints GB/s of the exported bytes for both and the ratio export/copy (`--json PATH` also writes
them as JSON, for tools/gpu/check.py). `--profile N` then runs one more export under
torch.profiler and prints its N most expensive ops (self device time on CUDA, self CPU time on
CPU), the tensors streamed and the device kernels launched: where an export slower than the
copy spends its time (launch-bound per tensor, or bytes moved more than once).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def model_config(args) -> dict:
    return dict(model_type="qwen2", hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
                num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                max_position_embeddings=4096, tie_word_embeddings=False)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def export_profile(run_export, a, counts: dict) -> dict:
    """One export under torch.profiler: prints the `a.profile` most expensive ops and returns
    {tensors, device_kernels, device_ms, top: [{name, calls, self_cpu_us, self_device_us}]}."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = a.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(a.device)
    with profile(activities=activities) as prof:
        run_export()
        _sync(a.device)
    events = prof.key_averages()
    device_us = lambda e: getattr(e, "self_device_time_total", 0.0)  # noqa: E731
    cost = device_us if cuda else (lambda e: e.self_cpu_time_total)
    print(events.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=a.profile))
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    top = sorted(events, key=cost, reverse=True)[:a.profile]
    figures = dict(tensors=counts["tensors"], device_kernels=sum(e.count for e in kernels),
                   device_ms=sum(device_us(e) for e in kernels) / 1e3,
                   top=[dict(name=e.key, calls=e.count, self_cpu_us=e.self_cpu_time_total, self_device_us=device_us(e))
                        for e in top])
    print(f"   profiled export: {figures['tensors']} tensors, {figures['device_kernels']} device kernels, "
          f"{figures['device_ms']:.2f} ms of device time")
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", choices=DTYPES, default="fp32", help="export dtype (the model is fp32 on cpu)")
    ap.add_argument("--bucket-mb", type=int, default=0, help="pack into buckets of this size (0: per tensor)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--json", metavar="PATH", default=None, help="also write the figures to PATH as JSON (rank 0)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="profile one more export and print its N most expensive ops (0: no profile)")
    a = ap.parse_args()

    from mrl.models.megatron import complete_hf_config
    from mrl.models.roles import build_role_model
    from mrl.platform import setup, teardown
    from mrl.platform.config import ParallelConfig, PlatformConfig
    from mrl.weights import Exporter, hf_buckets

    world = int(os.environ.get("WORLD_SIZE", "1"))
    parallel = ParallelConfig(tensor=a.tp, distributed_optimizer=False)
    ctx = setup(PlatformConfig(device=a.device, ranks_per_node=world, collective_timeout_s=600), parallel, seed=0)
    hf = complete_hf_config(model_config(a))
    model_dtype = "float32" if a.device == "cpu" else "bfloat16"
    model = build_role_model("actor", hf, parallel, dtype=model_dtype, device=a.device)
    params = [p for p in model.parameters()]
    local_bytes = sum(p.numel() * p.element_size() for p in params)
    dtype = DTYPES[a.dtype]
    exporter = Exporter([model], hf, dtype=dtype)

    counts = dict(tensors=0)

    def run_export() -> int:
        stream = exporter.stream()
        total = counts["tensors"] = 0
        if a.bucket_mb:
            for bucket in hf_buckets(stream, a.bucket_mb << 20):
                total += sum(t.numel() * t.element_size() for _, t in bucket)
                counts["tensors"] += len(bucket)
        else:
            for _, t in stream:
                total += t.numel() * t.element_size()
                counts["tensors"] += 1
        return total

    def run_copy() -> int:
        flat = torch.cat([p.detach().reshape(-1).to(dtype) for p in params])
        return flat.numel() * flat.element_size()

    results = {}
    for name, fn in (("export", run_export), ("copy", run_copy)):
        fn()  # warm-up
        times, nbytes = [], 0
        for _ in range(a.iters):
            _sync(a.device)
            t0 = time.perf_counter()
            nbytes = fn()
            _sync(a.device)
            times.append(time.perf_counter() - t0)
        results[name] = (statistics.median(times), nbytes)

    profile = export_profile(run_export, a, counts) if a.profile else None
    if ctx.is_main:
        n_params = sum(p.numel() for p in params) * a.tp
        print(f"== weight export  model: qwen2-shaped, {n_params / 1e6:.0f}M params, {a.layers} layers; "
              f"world {world}, TP {a.tp}; export dtype {a.dtype}; bucket {a.bucket_mb or 'none'} MB; "
              f"device {a.device}; threads {torch.get_num_threads()}")
        print(f"   local shard bytes: {local_bytes / 1e6:.0f} MB")
        for name, (t, nbytes) in results.items():
            print(f"   {name:7s} {nbytes / 1e6:8.0f} MB  {t * 1e3:8.1f} ms  {nbytes / t / 1e9:6.2f} GB/s")
        (te, be), (tc, bc) = results["export"], results["copy"]
        print(f"   ratio export/copy throughput: {(be / te) / (bc / tc):.2f}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(dict(device=a.device, dtype=a.dtype, params=n_params, layers=a.layers, tp=a.tp,
                               bucket_mb=a.bucket_mb, **{f"{k}_{q}": v for k, (t, nbytes) in results.items()
                                                         for q, v in (("ms", t * 1e3), ("bytes", nbytes),
                                                                      ("gbps", nbytes / t / 1e9))},
                               export_over_copy=(be / te) / (bc / tc), profile=profile), f, indent=1)
    teardown()


if __name__ == "__main__":
    main()
