"""Benchmark RoPE over a packed row: megatron's per-sequence `thd` path vs mrl's one-pass rotation.

    python tools/bench/rope.py                                        # CPU, fp32
    python tools/bench/rope.py --device cuda --dtype bf16             # GPU (same shapes)
    python tools/bench/rope.py --device cuda --dtype bf16 --tokens 16384 --sequences 512

One "layer" is RoPE on q `[T, heads, D]` and k `[T, kv_heads, D]`, forward and backward, as the
attention of one transformer layer runs it:

- `megatron`: megatron's unfused `apply_rotary_pos_emb(..., cu_seqlens=...)`, which splits the
  row per sequence and concatenates the frequency slices back (what megatron's `SelfAttention`
  runs for a packed row without Transformer Engine);
- `mrl`: `mrl.models.rope` - per-token positions from `cu_seqlens`, cos/sin gathered per token,
  then one rotation of q and of k. Timed twice: with the tables built every layer (`+tables`),
  and rotation only (`rotate`), which is what every layer after the first pays since the tables
  are built once per micro-batch.

Sequence lengths are a seeded random split of `--tokens` into `--sequences` (every length >= 1).
Both paths are checked to agree before timing. Times are medians over `--iters` rounds after
warm-up, each round running every variant once (interleaved, so load on a shared machine skews
none of them); on CUDA they are taken between synchronisations.

Measured on a shared 2-core CPU machine (fp32, one thread): at the defaults the elementwise
memory traffic dominates and mrl is 1.1-1.7x faster (it varies with the machine's load); with the
math made negligible (`--heads 1 --head-dim 8`), what is left is megatron's per-sequence host
work: 5.4 ms vs 0.74 ms per layer at 256 sequences, 22 ms vs 0.82 ms at 1024 (`--sequences 1024`).
On CUDA megatron's path also waits for the device (`cu_seqlens.tolist()`) for q and for k.
`--json PATH` also writes the times and ratios as JSON (for tools/gpu/check.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interleaved import interleaved_medians  # noqa: E402  (tools/bench/interleaved.py)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def split_lengths(tokens: int, sequences: int, seed: int = 0) -> list[int]:
    """`sequences` lengths >= 1 summing to `tokens` (a uniform random composition)."""
    g = torch.Generator().manual_seed(seed)
    cuts = (torch.randperm(tokens - 1, generator=g)[: sequences - 1] + 1).sort().values.tolist()
    bounds = [0, *cuts, tokens]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def rope_table(max_len: int, dim: int, device, base: float = 10000.0) -> torch.Tensor:
    """megatron's RoPE table layout `[max_len, 1, 1, dim]` (fp32 angles)."""
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32, device=device), inv_freq)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--sequences", type=int, default=256)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", metavar="PATH", default=None, help="also write the figures to PATH as JSON")
    args = ap.parse_args()
    if not 1 <= args.sequences <= args.tokens:
        ap.error("--sequences must be between 1 and --tokens")

    from mrl.models.rope import packed_positions, per_sequence_rope_reference, rope_tables, rotate

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    kv_heads = args.kv_heads or args.heads
    lengths = split_lengths(args.tokens, args.sequences)
    t, d = args.tokens, args.head_dim
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    freqs = rope_table(max(lengths), d, device)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(t, args.heads, d, generator=g, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(t, kv_heads, d, generator=g, device=device, dtype=dtype, requires_grad=True)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    tables = rope_tables(freqs, packed_positions(cu, t), dtype)

    def backward(qo, ko):
        q.grad = k.grad = None  # fresh gradients each run: no accumulation kernel in the timing
        torch.autograd.backward((qo, ko), (gq, gk))

    def megatron():
        backward(per_sequence_rope_reference(q, cu, freqs), per_sequence_rope_reference(k, cu, freqs))

    def mrl_with_tables():
        cos, sin = rope_tables(freqs, packed_positions(cu, t), dtype)
        backward(rotate(q, cos, sin), rotate(k, cos, sin))

    def mrl_rotate():
        backward(rotate(q, *tables), rotate(k, *tables))

    with torch.no_grad():
        diff = max((rotate(x, *tables) - per_sequence_rope_reference(x, cu, freqs)).abs().max().item() for x in (q, k))
    print(f"rope: {device.type}, {str(dtype).removeprefix('torch.')}, {t} tokens in {len(lengths)} sequences "
          f"(lengths {min(lengths)}..{max(lengths)}), q {args.heads} x {d}, k {kv_heads} x {d}, fwd+bwd of q and k; "
          f"max |mrl - megatron| {diff:.3g}")
    results = interleaved_medians({"megatron per-sequence thd": megatron, "mrl +tables": mrl_with_tables,
                                   "mrl rotate": mrl_rotate}, args.iters, args.warmup, sync)
    base = results["megatron per-sequence thd"]
    for name, sec in results.items():
        print(f"  {name:<28} {sec * 1e3:9.3f} ms  {base / sec:6.1f}x")
    print(f"  ratio megatron / mrl: {base / results['mrl +tables']:.1f}x with tables per layer, "
          f"{base / results['mrl rotate']:.1f}x per layer after the first")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device.type, dtype=str(dtype).removeprefix("torch."), tokens=t,
                           sequences=len(lengths), max_abs_diff=diff, ms={k: v * 1e3 for k, v in results.items()},
                           megatron_over_mrl_with_tables=base / results["mrl +tables"],
                           megatron_over_mrl_rotate=base / results["mrl rotate"]), f, indent=1)


if __name__ == "__main__":
    main()
