"""Benchmark mrl's fused log-prob/entropy kernels against torch eager and liger-kernel.

    python tools/bench/kernels.py                                   # CPU: the torch twins, small
    python tools/bench/kernels.py --n 16384 --v 152064 --dtype bf16 # GPU (these are the defaults)

Two sections, each printing time, peak memory and effective bandwidth side by side, then ratios:

1. logits -> (logp, entropy): mrl (Triton on CUDA, twin on CPU), torch eager
   (log_softmax + gather + entropy in fp32) and liger cross-entropy (log-prob only; it computes
   the gradient during the forward pass, so only fwd+bwd is comparable).
   Effective bytes: forward N*V*elem (logits read once) + outputs; backward reads the logits and
   writes the gradient, 2*N*V*elem. Targets on GPU: forward >= 85% of HBM bandwidth and >= 3x
   eager.
2. hidden, weight -> (logp, entropy): mrl fused linear path, eager (matmul + eager), liger fused
   linear cross-entropy (log-prob only). Target: fused peak memory <= 1/8 of eager's.

Peak memory is what the variant allocates above its inputs: the CUDA caching allocator's peak on
GPU, the storage accounting of mrl_kernels.memtrack on CPU. A variant that runs out of GPU memory
is retried on fewer rows and its time and memory are scaled linearly (marked with *).
`--sweep` times the Triton kernels over BLOCK_V x num_warps (GPU only). `--json PATH` also writes
every row and the ratios above as JSON (percentages as numbers, null where not measured) for
tools/gpu/check.py; the printed output is the same.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch


def _import_mrl_kernels():
    """`mrl_kernels`, installed or straight from this checkout's kernels/ (e.g. on a GPU box
    where the repo was copied but not pip-installed)."""
    try:
        import mrl_kernels
    except ImportError:
        kernels_dir = Path(__file__).resolve().parents[2] / "kernels"
        spec = importlib.util.spec_from_file_location(
            "mrl_kernels", kernels_dir / "__init__.py", submodule_search_locations=[str(kernels_dir)])
        mrl_kernels = importlib.util.module_from_spec(spec)
        sys.modules["mrl_kernels"] = mrl_kernels
        spec.loader.exec_module(mrl_kernels)
    return mrl_kernels


mrl_kernels = _import_mrl_kernels()
from mrl_kernels.memtrack import PeakMemory  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ------------------------------------------------------------------------------------------
# Device facts and measurement.
# ------------------------------------------------------------------------------------------

def hbm_bytes_per_s(device: torch.device, override_tbps: float | None) -> tuple[str, float | None]:
    """(device name, peak HBM bandwidth in B/s or None when unknown)."""
    if override_tbps:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        return name, override_tbps * 1e12
    if device.type != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(device)
    upper = name.upper()
    if "H200" in upper:
        return name, 4.8e12
    if "H100" in upper:
        return name, (2.0e12 if "PCIE" in upper else 3.35e12)
    return name, None


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, iters: int, warmup: int, device) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def peak_bytes(fn, device) -> int:
    with PeakMemory(device) as pm:
        fn()
    return pm.peak


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


@dataclass
class Row:
    variant: str
    phase: str
    ms: float | None = None
    peak: float | None = None        # bytes
    bytes_moved: float | None = None  # effective bytes for GB/s
    flops: float | None = None
    scaled: bool = False              # measured on fewer rows and scaled up (after an OOM)
    note: str = ""


def measure(variant, phase, make_fn, n, iters, warmup, device, bytes_moved=None, flops=None) -> Row:
    """Time and peak of make_fn(rows)(); on CUDA OOM retry with n/2, n/4, n/8 rows and scale."""
    rows = n
    while True:
        try:
            fn = make_fn(rows)
            ms = time_ms(fn, iters, warmup, device)
            peak = peak_bytes(fn, device)
            scale = n / rows
            return Row(variant, phase, ms * scale, peak * scale, bytes_moved, flops, scaled=rows != n)
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is a RuntimeError
            oom, message = is_oom(exc), str(exc)
        # Outside the except block: the traceback (and the tensors its frames hold) is gone.
        fn = None
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
        if not oom or rows <= max(1, n // 8):
            return Row(variant, phase, note="OOM" if oom else f"error: {message[:60]}")
        rows //= 2


def print_table(title: str, rows: list[Row], hbm: float | None) -> None:
    print(f"\n== {title}")
    head = (f"{'variant':<34}{'pass':<9}{'time ms':>10}{'peak MiB':>11}{'eff GB/s':>10}"
            f"{'%HBM':>7}{'TFLOP/s':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        if r.ms is None:
            print(f"{r.variant:<34}{r.phase:<9}{r.note:>10}")
            continue
        star = "*" if r.scaled else " "
        gbs = r.bytes_moved / (r.ms * 1e-3) / 1e9 if r.bytes_moved else None
        pct = f"{100 * gbs * 1e9 / hbm:6.1f}%" if (gbs and hbm) else f"{'-':>7}"
        tfl = f"{r.flops / (r.ms * 1e-3) / 1e12:9.1f}" if r.flops else f"{'-':>9}"
        gbs_s = f"{gbs:10.1f}" if gbs else f"{'-':>10}"
        peak = f"{r.peak / 2**20:10.1f}{star}" if r.peak is not None else f"{'-':>11}"
        note = f"  {r.note}" if r.note else ""
        print(f"{r.variant:<34}{r.phase:<9}{r.ms:9.3f}{star}{peak}{gbs_s}{pct}{tfl}{note}")


def find(rows, variant_prefix, phase):
    for r in rows:
        if r.variant.startswith(variant_prefix) and r.phase == phase and r.ms is not None:
            return r
    return None


def ratio(a, b):
    return a / b if (a is not None and b) else None


def fmt(x, spec=".2f", suffix=""):
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


# ------------------------------------------------------------------------------------------
# The compared implementations.
# ------------------------------------------------------------------------------------------

def eager_logprob_entropy(logits, labels, temperature):
    """What RL code typically does: fp32 log_softmax over the vocabulary, gather, entropy."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    p = logp_all.exp()
    return logp, -(p * logp_all).sum(-1)


def load_liger():
    """liger-kernel's functional API, or a reason why it cannot run here."""
    try:
        from liger_kernel.transformers.functional import (
            liger_cross_entropy, liger_fused_linear_cross_entropy)
    except Exception as exc:  # noqa: BLE001 - any import problem means "not available"
        return None, f"liger-kernel unavailable ({type(exc).__name__})"
    return (liger_cross_entropy, liger_fused_linear_cross_entropy), ""


def two_output_step(fn, inputs, grads):
    """fwd+bwd: forward, then gradients of (logp, entropy) w.r.t. inputs (no .grad accumulation)."""
    def step():
        logp, ent = fn(*inputs)
        torch.autograd.grad([logp, ent], [t for t in inputs if t.requires_grad], grads)
    return step


# ------------------------------------------------------------------------------------------
# Sections.
# ------------------------------------------------------------------------------------------

def bench_logprob(args, device, dtype, hbm, mrl_name, liger):
    n, v, t = args.n, args.v, args.temperature
    elem = torch.finfo(dtype).bits // 8
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = (torch.randn(n, v, generator=g, dtype=torch.float32) * 2).to(device, dtype)
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    gl, gh = torch.randn(2, n, generator=g).to(device)

    small = n * (8 + 2 * 4)  # labels in, two fp32 outputs
    fwd_bytes, bwd_bytes = n * v * elem + small, 2 * n * v * elem + 4 * n * 4
    rows: list[Row] = []

    def fwd_of(fn):
        def make(r):
            x = logits[:r]
            lab = labels[:r]
            def run():
                with torch.no_grad():
                    fn(x, lab, t)
            return run
        return make

    def step_of(fn):
        def make(r):
            x = logits[:r].detach().requires_grad_()
            return two_output_step(lambda xx: fn(xx, labels[:r], t), (x,), (gl[:r], gh[:r]))
        return make

    impls = [(mrl_name, lambda x, lab, tt: mrl_kernels.logprob_entropy(x, lab, tt)),
             ("torch eager", eager_logprob_entropy)]
    for name, fn in impls:
        rows.append(measure(name, "fwd", fwd_of(fn), n, args.iters, args.warmup, device, fwd_bytes))
        rows.append(measure(name, "fwd+bwd", step_of(fn), n, args.iters, args.warmup, device,
                            fwd_bytes + bwd_bytes))
    if liger and device.type == "cuda":
        ce = liger[0]
        def make_liger(r):
            # liger writes the logits gradient into its input during the forward pass: own copy.
            x = logits[:r].clone().requires_grad_()
            def run():
                loss = ce(x, labels[:r], reduction="sum")
                torch.autograd.grad(loss, x)
            return run
        rows.append(measure("liger cross_entropy (logp only)", "fwd+bwd", make_liger, n, args.iters,
                            args.warmup, device, fwd_bytes + bwd_bytes))
    else:
        rows.append(Row("liger cross_entropy (logp only)", "fwd+bwd",
                        note=liger_note(liger, device)))

    # Correctness of the measured implementation on this very data (sanity on a new GPU).
    with torch.no_grad():
        k = min(n, 1024)
        a = mrl_kernels.logprob_entropy(logits[:k], labels[:k], t)
        b = eager_logprob_entropy(logits[:k], labels[:k], t)
    err = max((a[0] - b[0]).abs().max().item(), (a[1] - b[1]).abs().max().item()) if k else 0.0

    print_table(f"logprob_entropy  N={n} V={v} dtype={args.dtype} T={t}", rows, hbm)
    mf, ef = find(rows, mrl_name, "fwd"), find(rows, "torch eager", "fwd")
    mb, eb = find(rows, mrl_name, "fwd+bwd"), find(rows, "torch eager", "fwd+bwd")
    lb = find(rows, "liger", "fwd+bwd")
    fwd_pct = (fwd_bytes / (mf.ms * 1e-3) / hbm * 100) if (mf and hbm) else None
    bwd_ms = (mb.ms - mf.ms) if (mb and mf) else None
    bwd_pct = (bwd_bytes / (bwd_ms * 1e-3) / hbm * 100) if (bwd_ms and bwd_ms > 0 and hbm) else None
    speed_f = ratio(ef.ms if ef else None, mf.ms if mf else None)
    speed_b = ratio(eb.ms if eb else None, mb.ms if mb else None)
    print(f"max |mrl - eager| (logp, entropy; first {k} rows): {err:.3g}")
    print(f"forward: {mrl_name} vs eager speedup {fmt(speed_f, '.2f', 'x')}, "
          f"{fmt(fwd_pct, '.1f', '%')} of HBM bandwidth")
    print(f"backward (fwd+bwd minus fwd): {fmt(bwd_ms, '.3f', ' ms')}, "
          f"{fmt(bwd_pct, '.1f', '%')} of HBM bandwidth")
    print(f"fwd+bwd: vs eager speedup {fmt(speed_b, '.2f', 'x')}, vs liger CE "
          f"{fmt(ratio(lb.ms if lb else None, mb.ms if mb else None), '.2f', 'x')}; peak memory "
          f"mrl/eager {fmt(ratio(mb.peak if mb else None, eb.peak if eb else None), '.3f')}")
    if device.type == "cuda":
        ok = fwd_pct is not None and fwd_pct >= 85 and speed_f is not None and speed_f >= 3
        print(f"target (forward >= 85% HBM and >= 3x eager): {'MET' if ok else 'NOT MET'}")
    del logits
    return dict(n=n, v=v, dtype=args.dtype, rows=row_dicts(rows), max_err=err, fwd_pct_hbm=fwd_pct,
                bwd_ms=bwd_ms, bwd_pct_hbm=bwd_pct, eager_over_mrl_fwd=speed_f, eager_over_mrl_fwd_bwd=speed_b,
                liger_over_mrl_fwd_bwd=ratio(lb.ms if lb else None, mb.ms if mb else None),
                peak_mrl_over_eager=ratio(mb.peak if mb else None, eb.peak if eb else None))


def bench_linear(args, device, dtype, mrl_name, liger):
    n, v, h, t = args.n, args.v, args.h, args.temperature
    g = torch.Generator(device="cpu").manual_seed(1)
    hidden = torch.randn(n, h, generator=g).to(device, dtype)
    weight = (torch.randn(v, h, generator=g) / h ** 0.5).to(device, dtype)
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    gl, gh = torch.randn(2, n, generator=g).to(device)
    fwd_flops = 2.0 * n * v * h
    rows: list[Row] = []

    def eager(hh, ww, lab, tt):
        return eager_logprob_entropy(hh @ ww.T, lab, tt)

    def fused(hh, ww, lab, tt):
        return mrl_kernels.linear_logprob_entropy(hh, ww, lab, tt, chunk_tokens=args.chunk_tokens,
                                                  chunk_vocab=args.chunk_vocab)

    for name, fn in ((f"{mrl_name} fused linear", fused), ("torch eager (matmul + eager)", eager)):
        def make_fwd(r, fn=fn):
            def run():
                with torch.no_grad():
                    fn(hidden[:r], weight, labels[:r], t)
            return run

        def make_step(r, fn=fn):
            hh = hidden[:r].detach().requires_grad_()
            ww = weight.detach().requires_grad_()
            return two_output_step(lambda a, b: fn(a, b, labels[:r], t), (hh, ww), (gl[:r], gh[:r]))
        rows.append(measure(name, "fwd", make_fwd, n, args.iters, args.warmup, device, flops=fwd_flops))
        rows.append(measure(name, "fwd+bwd", make_step, n, args.iters, args.warmup, device,
                            flops=3 * fwd_flops))
    if liger and device.type == "cuda":
        flce = liger[1]
        def make_liger(r):
            hh = hidden[:r].detach().requires_grad_()
            ww = weight.detach().requires_grad_()
            def run():
                loss = flce(hh, ww, labels[:r], reduction="sum")
                torch.autograd.grad(loss, [hh, ww])
            return run
        rows.append(measure("liger fused linear CE (logp only)", "fwd+bwd", make_liger, n,
                            args.iters, args.warmup, device, flops=3 * fwd_flops))
    else:
        rows.append(Row("liger fused linear CE (logp only)", "fwd+bwd", note=liger_note(liger, device)))

    print_table(f"linear -> logprob_entropy  N={n} V={v} H={h} dtype={args.dtype} "
                f"(TFLOP/s counts 2NVH fwd, 6NVH fwd+bwd)", rows, None)
    mb, eb = find(rows, mrl_name, "fwd+bwd"), find(rows, "torch eager", "fwd+bwd")
    lb = find(rows, "liger", "fwd+bwd")
    mem = ratio(mb.peak if mb else None, eb.peak if eb else None)
    print(f"fwd+bwd peak memory: fused/eager {fmt(mem, '.3f')} (target <= 0.125: "
          f"{'n/a' if mem is None else ('MET' if mem <= 0.125 else 'NOT MET')}), fused/liger "
          f"{fmt(ratio(mb.peak if mb else None, lb.peak if lb else None), '.2f')}; time: eager/fused "
          f"{fmt(ratio(eb.ms if eb else None, mb.ms if mb else None), '.2f', 'x')}, liger/fused "
          f"{fmt(ratio(lb.ms if lb else None, mb.ms if mb else None), '.2f', 'x')}")
    return dict(n=n, v=v, h=h, dtype=args.dtype, rows=row_dicts(rows), peak_fused_over_eager=mem,
                peak_fused_over_liger=ratio(mb.peak if mb else None, lb.peak if lb else None),
                eager_over_fused_fwd_bwd=ratio(eb.ms if eb else None, mb.ms if mb else None),
                liger_over_fused_fwd_bwd=ratio(lb.ms if lb else None, mb.ms if mb else None))


def row_dicts(rows: list[Row]) -> list[dict]:
    return [dataclasses.asdict(r) for r in rows]


def liger_note(liger, device):
    if device.type != "cuda":
        return "skipped (liger needs CUDA)"
    return "skipped (liger-kernel not installed)" if not liger else ""


def sweep(args, device, dtype, hbm) -> list[dict]:
    """Time the Triton forward/backward kernels over launch configurations; the rows as dicts
    (block_v, num_warps, fwd_ms, fwd_pct_hbm, bwd_ms, bwd_pct_hbm; `error` when a config failed)."""
    import mrl_kernels.logprob_triton as kt
    n, v = args.n, args.v
    elem = torch.finfo(dtype).bits // 8
    logits = (torch.randn(n, v, device=device) * 2).to(dtype)
    labels = torch.randint(0, v, (n,), device=device)
    out = kt.fused_forward(logits, labels, 1.0)
    lse, mu = out[2].contiguous(), out[3].contiguous()
    g = torch.randn(n, device=device)
    grad = torch.empty_like(logits)
    print(f"\n== sweep  N={n} V={v} dtype={args.dtype} (default config: {kt.default_config(v, device)})")
    print(f"{'BLOCK_V':>8}{'warps':>6}{'fwd ms':>9}{'fwd %HBM':>10}{'bwd ms':>9}{'bwd %HBM':>10}")
    rows = []
    for block in (1024, 2048, 4096, 8192, 16384):
        for warps in (4, 8, 16, 32):
            if block // (32 * warps) < 1:
                continue
            try:
                f = time_ms(lambda: kt.fused_forward(logits, labels, 1.0, block_v=block, num_warps=warps),
                            args.iters, args.warmup, device)
                b = time_ms(lambda: kt.grad(logits, labels, 0, 1.0, -100, lse, mu, g, g, out=grad,
                                            block_v=block, num_warps=warps), args.iters, args.warmup, device)
            except Exception as exc:  # noqa: BLE001 - report and go on (e.g. out of registers)
                print(f"{block:>8}{warps:>6}  failed: {str(exc)[:60]}")
                rows.append(dict(block_v=block, num_warps=warps, error=str(exc)[:200]))
                continue
            fp = 100 * n * v * elem / (f * 1e-3) / hbm if hbm else float("nan")
            bp = 100 * 2 * n * v * elem / (b * 1e-3) / hbm if hbm else float("nan")
            print(f"{block:>8}{warps:>6}{f:9.3f}{fp:9.1f}%{b:9.3f}{bp:9.1f}%")
            rows.append(dict(block_v=block, num_warps=warps, fwd_ms=f, fwd_pct_hbm=fp, bwd_ms=b, bwd_pct_hbm=bp))
    return rows


def main(argv=None):
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=16384 if gpu else 512, help="tokens (rows)")
    p.add_argument("--v", type=int, default=152064 if gpu else 32768, help="vocabulary size")
    p.add_argument("--h", type=int, default=4096 if gpu else 128, help="hidden size (linear section)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--iters", type=int, default=20 if gpu else 3)
    p.add_argument("--warmup", type=int, default=5 if gpu else 1)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--chunk-tokens", type=int, default=None, help="fused linear tile (tokens)")
    p.add_argument("--chunk-vocab", type=int, default=None, help="fused linear tile (vocabulary)")
    p.add_argument("--section", choices=["all", "logprob", "linear"], default="all")
    p.add_argument("--sweep", action="store_true", help="also sweep Triton BLOCK_V x num_warps (GPU)")
    p.add_argument("--hbm-tbps", type=float, default=None, help="override peak HBM bandwidth (TB/s)")
    p.add_argument("--device", default="cuda" if gpu else "cpu")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the figures to PATH as JSON")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    name, hbm = hbm_bytes_per_s(device, args.hbm_tbps)
    from mrl_kernels import _dispatch
    probe = torch.empty(1, dtype=dtype, device=device)
    backend = _dispatch.select_backend(probe)
    mrl_name = f"mrl ({'triton' if backend == 'triton' else 'torch twin'})"
    liger, why = load_liger() if device.type == "cuda" else (None, "")
    print(f"device: {name}" + (f", peak HBM {hbm / 1e12:.2f} TB/s" if hbm else "")
          + f" | torch {torch.__version__} | backend {backend}"
          + (f" | {why}" if why else "")
          + (f" | {os.environ.get(_dispatch.ENV_VAR)} forced" if os.environ.get(_dispatch.ENV_VAR) else ""))
    figures = dict(device=device.type, device_name=name, hbm_bytes_per_s=hbm, backend=backend,
                   torch=torch.__version__, liger=bool(liger), liger_note=why or liger_note(liger, device),
                   logprob=None, linear=None)
    if args.section in ("all", "logprob"):
        figures["logprob"] = bench_logprob(args, device, dtype, hbm, mrl_name, liger)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.section in ("all", "linear"):
        figures["linear"] = bench_linear(args, device, dtype, mrl_name, liger)
    if args.sweep:
        if device.type == "cuda" and backend == "triton":
            figures["sweep"] = sweep(args, device, dtype, hbm)
        else:
            print("\n--sweep needs a CUDA device and triton")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
