"""Benchmark a checkpoint save against the bytes it writes and a plain `torch.save` of the same tensors.

    python tools/bench/checkpoint.py                    # SmolLM2-135M's shape, fp32, distributed optimizer, 1 rank
    python tools/bench/checkpoint.py --saves 3 --profile 25   # also cProfile one save: the top 25 by cumulative time
    python tools/bench/checkpoint.py --layers 2         # a smaller model
    python tools/bench/checkpoint.py --tiny --layers 1 --saves 1   # the smoke test
    python tools/bench/checkpoint.py --dtype bfloat16   # a bf16 model (fp32 master weights of their own)

Builds the SmolLM2 job's actor on this rank (megatron GPTModel of SmolLM2-135M-Instruct's shape,
random weights, fp32, the distributed optimizer with its Adam state materialised, as a save after
the first update holds it), then in one run:

- `mrl save`: `mrl.checkpoint.state.save` (the model in megatron's torch_dist format, the
  optimizer in mrl's per-rank format, the RNG file, the manifest and the atomic commit with its
  fsyncs), `--saves` times into a fresh root (`keep_last=1`);
- `mrl save, torch_dist optim`: the same with the optimizer in megatron's 'fully_reshardable'
  torch_dist format (`optimizer_format="torch_dist"`, the format of older saves);
- `mrl save, sha256`: `mrl save` with the manifest hashed by SHA-256 (format 1, as saves were
  before XXH3-128); the three alternate;
- `torch.save`: the same tensors (the model's state dict and the optimizer's fp32 master weights
  and two Adam moments per parameter; torch.save writes storage shared by several tensors once,
  so an fp32 model's weights, which are its master weights, once) in one file, then fsynced;
- loads of each checkpoint into the same model and optimizer (`mrl.checkpoint.state.load`: the
  manifest check, the model, the optimizer) against `torch.load` of that file;
- the bytes each wrote, and each one's rate (MB/s); the ratios of the times are what a save or a
  load costs beyond moving its bytes.

`--profile N` runs one more save under cProfile and prints its top N functions by cumulative time
(what is not I/O: the save strategy, per-file fsyncs, the writer threads, the manifest hashing).
The load average is printed with the figures.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

SMOLLM2 = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
               rope_theta=100000.0, tie_word_embeddings=True)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _plain_save(model, opt, path: Path) -> None:
    """The same tensors as one plain `torch.save`: weights, fp32 master weights, Adam moments."""
    tensors = {f"model/{k}": v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    for i, inner in enumerate(getattr(opt, "chained_optimizers", None) or [opt]):
        for j, (p, st) in enumerate(inner.optimizer.state.items()):
            tensors[f"optim{i}/{j}/param"] = p.detach()
            for k, v in st.items():
                if torch.is_tensor(v) and v.numel() > 1:
                    tensors[f"optim{i}/{j}/{k}"] = v
    torch.save(tensors, path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=2)
    ap.add_argument("--layers", type=int, default=SMOLLM2["num_hidden_layers"])
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--tiny", action="store_true", help="a tiny model of the same family (the smoke test)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile one more save; print the top N")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args(argv)
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="29541").items():
        os.environ.setdefault(k, v)

    from mrl import platform
    from mrl.checkpoint import state
    from mrl.models.megatron import build_gpt, transformer_config
    from mrl.optim import build_optimizer, build_scheduler, wrap_ddp
    from mrl.optim.config import OptimConfig, ScheduleConfig
    from mrl.platform.config import ParallelConfig, PlatformConfig

    hf = dict(SMOLLM2, num_hidden_layers=args.layers)
    if args.tiny:
        hf.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    parallel = ParallelConfig(distributed_optimizer=True)
    work = Path(args.dir or tempfile.mkdtemp(prefix="mrl-ckpt-bench-"))
    with platform.setup(PlatformConfig(device="cpu", nodes=1, ranks_per_node=1), parallel, seed=1):
        cfg = transformer_config(hf, dtype=args.dtype, parallel=parallel, device="cpu")
        model = build_gpt(hf, cfg)
        ddp = wrap_ddp([model], distributed_optimizer=True, overlap_grad_reduce=False)
        optim = OptimConfig(lr=1e-6, grad_clip=1.0)
        opt = build_optimizer(ddp, optim, distributed_optimizer=True)
        sched = build_scheduler(opt, optim, ScheduleConfig(), 100)
        state._ensure_optimizer_state(opt)   # the Adam moments a save after the first update holds
        params = sum(p.numel() for p in model.parameters())

        def mrl_save(step: int, hash_name: str = state.manifest.HASH, optimizer_format: str = "mrl") -> float:
            saved, state.manifest.HASH = state.manifest.HASH, hash_name
            t0 = time.perf_counter()
            state.save(work / ("ckpt" if optimizer_format == "mrl" else f"ckpt_{optimizer_format}"), step, chunks=ddp,
                       optimizer=opt, scheduler=sched, extra={"bench": True}, keep_last=1,
                       optimizer_format=optimizer_format)
            state.manifest.HASH = saved
            return time.perf_counter() - t0

        def mrl_load(root: Path) -> float:
            t0 = time.perf_counter()
            state.load(root, chunks=ddp, optimizer=opt, scheduler=sched)
            return time.perf_counter() - t0

        load0 = os.getloadavg()
        mrl_s, sha_s, old_s = [], [], []
        for i in range(args.saves):
            old_s.append(mrl_save(i + 1, optimizer_format="torch_dist"))
            sha_s.append(mrl_save(100 + i, "sha256"))
            mrl_s.append(mrl_save(i + 1))
        mrl_bytes = _dir_bytes(work / "ckpt" / state.store.step_name(args.saves))
        old_bytes = _dir_bytes(work / "ckpt_torch_dist" / state.store.step_name(args.saves))
        plain_s = []
        for i in range(args.saves):
            t0 = time.perf_counter()
            _plain_save(model, opt, work / "plain.pt")
            plain_s.append(time.perf_counter() - t0)
        plain_bytes = (work / "plain.pt").stat().st_size
        load_s, old_load_s, plain_load_s = [], [], []
        for _ in range(args.saves):
            old_load_s.append(mrl_load(work / "ckpt_torch_dist"))
            load_s.append(mrl_load(work / "ckpt"))
            t0 = time.perf_counter()
            torch.load(work / "plain.pt", weights_only=True)
            plain_load_s.append(time.perf_counter() - t0)
        load1 = os.getloadavg()
        print(f"checkpoint save: {'a tiny' if args.tiny else 'SmolLM2-135M'} shape ({args.layers} layers, {params / 1e6:.1f}M params, {args.dtype}, "
              f"distributed optimizer, 1 rank); {args.saves} saves each; load average {load0[0]:.2f} "
              f"(after: {load1[0]:.2f})")
        print(f"  {'what':<30} {'best s':>8} {'mean s':>8} {'MB written':>11} {'MB/s':>8}")
        for name, ts, nbytes in (("mrl save, torch_dist optim", old_s, old_bytes),
                                 ("mrl save, sha256", sha_s, mrl_bytes), ("mrl save", mrl_s, mrl_bytes),
                                 ("torch.save", plain_s, plain_bytes),
                                 ("mrl load, torch_dist optim", old_load_s, old_bytes),
                                 ("mrl load", load_s, mrl_bytes), ("torch.load", plain_load_s, plain_bytes)):
            print(f"  {name:<30} {min(ts):>8.2f} {sum(ts) / len(ts):>8.2f} {nbytes / 1e6:>11.1f} "
                  f"{nbytes / min(ts) / 1e6:>8.1f}")
        print(f"  mrl save / torch.save (best): {min(mrl_s) / min(plain_s):.2f}x time, "
              f"{mrl_bytes / plain_bytes:.2f}x bytes; sha256 manifest / xxh3 manifest: {min(sha_s) / min(mrl_s):.2f}x")
        print(f"  torch_dist optim save / torch.save (best): {min(old_s) / min(plain_s):.2f}x time, "
              f"{old_bytes / plain_bytes:.2f}x bytes; torch_dist optim / mrl save: {min(old_s) / min(mrl_s):.2f}x")
        print(f"  mrl load / torch.load (best): {min(load_s) / min(plain_load_s):.2f}x; torch_dist optim load / "
              f"torch.load: {min(old_load_s) / min(plain_load_s):.2f}x")
        ckpt = work / "ckpt" / state.store.step_name(args.saves)
        files = state.manifest.listed_files(ckpt)
        for algorithm in ("sha256", "xxh3_128"):
            t0 = time.perf_counter()
            for rel in files:
                state.manifest.file_entry(ckpt / rel, algorithm)
            sec = time.perf_counter() - t0
            print(f"  manifest hashing alone, {algorithm:<8}: {sec:6.2f} s for {mrl_bytes / 1e6:.0f} MB "
                  f"({mrl_bytes / sec / 1e9:.2f} GB/s, files in the page cache)")
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            mrl_save(args.saves + 1)
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(args.profile)
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.profile)
            print(out.getvalue())
    if args.dir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
