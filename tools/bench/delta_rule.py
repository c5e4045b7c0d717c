"""Benchmark the gated delta rule's torch twins: the token-by-token recurrence vs the chunked form.

    python tools/bench/delta_rule.py                                   # CPU, the default grid
    python tools/bench/delta_rule.py --tokens 256 1024 --shapes tiny   # a smaller grid
    python tools/bench/delta_rule.py --sequences 8                     # packed rows of 8 sequences

For each head shape and row length T, one packed row (`--sequences` sequences, a seeded random
split of T) runs forward and backward through `mrl.platform.delta_rule.recurrent_twin` (T Python
steps, the reference) and `chunked_twin` (one triangular solve per 64-token chunk, one step per
chunk: what `gated_delta_rule` runs off CUDA), side by side:

- time: the median of `--iters` rounds after `--warmup`, each round running both (interleaved,
  so load on a shared machine skews neither);
- memory: the bytes autograd keeps for the backward, counted exactly by
  `torch.autograd.graph.saved_tensors_hooks` (each storage a saved tensor lives in, once; the
  inputs included). tracemalloc and the profiler do not see torch's CPU allocator well; these are
  the bytes that grow with T.

Shapes (`--shapes`): `tiny` is the builtin tiny hybrids' (2 key heads serving 4 value heads of
32), `qwen3.5` a Qwen3.5-like head size (d_k = d_v = 128, 2 key heads serving 4 value heads).
The two twins are checked to agree (max |chunked - recurrent| printed) before timing.

Measured on the shared 2-core CPU machine (fp32, `--threads 1`, one sequence per row; times vary
with the machine's load), recurrent / chunked:

    shape    T      chunked ms  saved MiB   recurrent ms  saved MiB   time   memory
    tiny     256        6.3        3.1          47.9         8.7      7.6x   2.8x
    tiny     1024      25.5       12.3         253.9        34.6      9.9x   2.8x
    tiny     4096     150.0       49.3        1972.1       138.2     13.1x   2.8x
    qwen3.5  256       18.2        9.3         112.3       130.8      6.2x  14.1x
    qwen3.5  1024      78.9       37.1         692.5       522.3      8.8x  14.1x
    qwen3.5  4096     516.3      148.3        7929.4      2088.5     15.4x  14.1x

With `--sequences 16` (a seeded random split, so the recurrence pads every sequence to the
longest): qwen3.5 T=1024 165 ms / 63 MiB chunked vs 5656 ms / 4101 MiB (34x, 65x); T=4096
408 ms / 180 MiB vs 6808 ms / 4774 MiB (17x, 26x); tiny T=1024 18x, 13x; T=4096 8.5x, 5.4x.

Both keep memory linear in T; the chunked twin keeps per token a few `[C]` rows of the chunk's
`[C, C]` matrices where the recurrence keeps its `[d_k, d_v]` states, so the gap is d_k d_v / C
(small at 32 x 32, 14x at 128 x 128). The time gap grows with T: the recurrence's T small Python
steps against T / C larger matmuls. `--skip-recurrent-above T` skips the recurrence on longer
rows; `--json PATH` also writes the figures as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interleaved import interleaved_medians  # noqa: E402  (tools/bench/interleaved.py)

SHAPES = {"tiny": (2, 4, 32, 32), "qwen3.5": (2, 4, 128, 128)}     # H_k, H_v, d_k, d_v


def split_lengths(tokens: int, sequences: int, seed: int = 0) -> list[int]:
    """`sequences` lengths >= 1 summing to `tokens` (a uniform random composition)."""
    g = torch.Generator().manual_seed(seed)
    cuts = (torch.randperm(tokens - 1, generator=g)[: sequences - 1] + 1).sort().values.tolist()
    bounds = [0, *cuts, tokens]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def rule_inputs(tokens: int, shape: tuple[int, int, int, int], seed: int = 0) -> list[torch.Tensor]:
    """q, k `[T, H_k, d_k]`, v `[T, H_v, d_v]`, g (<= 0) and beta `[T, H_v]`, leaves needing gradients."""
    hk, hv, dk, dv = shape
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(tokens, hk, dk, generator=g), torch.randn(tokens, hk, dk, generator=g),
          torch.randn(tokens, hv, dv, generator=g), -torch.rand(tokens, hv, generator=g) * 2.0,
          torch.rand(tokens, hv, generator=g)]
    return [x.requires_grad_() for x in xs]


def saved_bytes(fn, xs: list[torch.Tensor], cu: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The bytes of the storages autograd saves for `fn(*xs, cu)`'s backward (each storage once),
    and the output."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*xs, cu)
    return sum(storages.values()), out


def bench(tokens: int, shape_name: str, sequences: int, iters: int, warmup: int, skip_recurrent_above: int) -> dict:
    """One grid point: times, saved bytes and their ratios, printed as one line and returned."""
    from mrl.platform.delta_rule import chunked_twin, recurrent_twin

    xs = rule_inputs(tokens, SHAPES[shape_name])
    lengths = split_lengths(tokens, sequences)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    weight = torch.randn(xs[2].shape, generator=torch.Generator().manual_seed(1))
    twins = {"chunked": chunked_twin}
    if tokens <= skip_recurrent_above:
        twins["recurrent"] = recurrent_twin
    memory, outs = {}, {}
    for name, fn in twins.items():
        memory[name], out = saved_bytes(fn, xs, cu)
        outs[name] = out.detach()
        del out

    def step(fn):
        def run():
            for x in xs:
                x.grad = None
            (fn(*xs, cu) * weight).sum().backward()
        return run

    seconds = interleaved_medians({name: step(fn) for name, fn in twins.items()}, iters, warmup)
    row = dict(shape=shape_name, tokens=tokens, sequences=sequences, ms={k: v * 1e3 for k, v in seconds.items()},
               saved_mib={k: v / 2 ** 20 for k, v in memory.items()})
    line = (f"  {shape_name:<8} T={tokens:<6} chunked {seconds['chunked'] * 1e3:9.1f} ms "
            f"{memory['chunked'] / 2 ** 20:9.1f} MiB saved")
    if "recurrent" in twins:
        row["max_abs_diff"] = (outs["chunked"] - outs["recurrent"]).abs().max().item()
        row["time_ratio"] = seconds["recurrent"] / seconds["chunked"]
        row["memory_ratio"] = memory["recurrent"] / memory["chunked"]
        line += (f" | recurrent {seconds['recurrent'] * 1e3:9.1f} ms {memory['recurrent'] / 2 ** 20:9.1f} MiB saved"
                 f" | recurrent/chunked: time {row['time_ratio']:6.1f}x, memory {row['memory_ratio']:6.1f}x"
                 f" | max |diff| {row['max_abs_diff']:.2g}")
    else:
        line += " | recurrent skipped (--skip-recurrent-above)"
    print(line, flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--sequences", type=int, default=1, help="sequences per packed row")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's own)")
    ap.add_argument("--skip-recurrent-above", type=int, default=1 << 30, metavar="T",
                    help="run the recurrent twin only for rows of at most T tokens")
    ap.add_argument("--json", metavar="PATH", default=None, help="also write the figures to PATH as JSON")
    args = ap.parse_args()
    if args.sequences < 1 or any(args.sequences > t for t in args.tokens):
        ap.error("--sequences must be between 1 and every --tokens")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"delta rule twins: cpu, float32, {torch.get_num_threads()} thread(s), fwd+bwd, "
          f"{args.sequences} sequence(s) per row; shapes (H_k, H_v, d_k, d_v): " + ", ".join(f"{s} {SHAPES[s]}" for s in args.shapes))
    rows = [bench(t, s, args.sequences, args.iters, args.warmup, args.skip_recurrent_above)
            for s in args.shapes for t in args.tokens]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
