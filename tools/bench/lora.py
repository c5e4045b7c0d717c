"""LoRA vs full fine-tuning: trainable parameters and training-state memory, from the model config.

    python tools/bench/lora.py                                   # Qwen2.5-1.5B, rank 16, all 7 projections
    python tools/bench/lora.py --rank 64 --targets q_proj,v_proj
    python tools/bench/lora.py --model path/to/hf_dir --dp 8     # any supported config; DP shards the optimizer

No GPU and no weights: the counts come from the architecture (`count_parameters`, which the smoke
test checks against a built megatron model with adapters). Memory is what megatron's mixed-precision
training holds per rank, with the model in `--dtype` (bf16 by default):

- weights: every parameter in the model dtype (the frozen base included);
- gradients: megatron's DDP buffers in fp32 (`grad_reduce_in_fp32`), trainable parameters only;
- optimizer: Adam's fp32 master weights + two fp32 moments = 12 bytes per trainable parameter,
  divided by `--dp` with the distributed optimizer.

Activations are the same for both (LoRA adds r-wide intermediates per adapted projection, small
next to the hidden size) and are not counted. Prints both columns and the LoRA/full ratios.
Step time side by side needs a GPU (`tools/bench/train_step.py` with `actor.lora`) and is not
measured here.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

QWEN25_15B = dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def projection_shapes(hf: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) of each HF projection of one decoder layer."""
    h, ffn = hf["hidden_size"], hf["intermediate_size"]
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    d = hf.get("head_dim") or h // heads
    return {"q_proj": (h, heads * d), "k_proj": (h, kv * d), "v_proj": (h, kv * d), "o_proj": (heads * d, h),
            "gate_proj": (h, ffn), "up_proj": (h, ffn), "down_proj": (ffn, h)}


def count_parameters(hf: dict[str, Any], *, rank: int = 0, targets: tuple[str, ...] = ()) -> dict[str, int]:
    """`{"total": model parameters (vocabulary as in the config), "lora": adapter parameters}` of a
    dense decoder (Llama / Qwen2 / Qwen3 families)."""
    shapes = projection_shapes(hf)
    h, layers, vocab = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
    per_layer = sum(i * o for i, o in shapes.values()) + 2 * h   # projections + 2 RMSNorms
    if hf["model_type"] == "qwen2" or hf.get("attention_bias"):
        per_layer += shapes["q_proj"][1] + 2 * shapes["k_proj"][1]   # q/k/v biases
    if hf["model_type"] in ("qwen3", "qwen3_moe"):
        per_layer += 2 * (hf.get("head_dim") or h // hf["num_attention_heads"])   # q/k norms
    total = layers * per_layer + h + vocab * h * (1 if hf.get("tie_word_embeddings") else 2)
    lora = layers * sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets)
    return {"total": total, "lora": lora}


def memory_bytes(trainable: int, total: int, *, dtype: str, dp: int) -> dict[str, float]:
    weights = total * BYTES[dtype]
    grads = trainable * 4
    optimizer = trainable * 12 / dp
    return {"weights": weights, "gradients": grads, "optimizer": optimizer, "total": weights + grads + optimizer}


def main(argv=None) -> None:
    from mrl.models.lora import HF_TARGETS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a Hugging Face directory (default: Qwen2.5-1.5B's config)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default=",".join(HF_TARGETS), help="comma-separated HF module names")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(BYTES))
    ap.add_argument("--dp", type=int, default=1, help="data-parallel ranks sharding the optimizer state")
    args = ap.parse_args(argv)
    if args.model:
        from mrl.models.config import ModelConfig
        from mrl.models.megatron import hf_config

        hf, name = hf_config(ModelConfig(path=args.model)), args.model
    else:
        hf, name = QWEN25_15B, "Qwen2.5-1.5B"
    targets = tuple(t for t in args.targets.split(",") if t)
    counts = count_parameters(hf, rank=args.rank, targets=targets)
    full = memory_bytes(counts["total"], counts["total"], dtype=args.dtype, dp=args.dp)
    lora = memory_bytes(counts["lora"], counts["total"] + counts["lora"], dtype=args.dtype, dp=args.dp)
    gib = 2 ** 30
    print(f"lora: {name} ({counts['total'] / 1e9:.3f}B params, {args.dtype}), rank {args.rank} on "
          f"{', '.join(targets)}, optimizer sharded over DP {args.dp}")
    print(f"  {'':<22}{'full':>14}{'lora':>14}{'lora/full':>12}")
    print(f"  {'trainable params':<22}{counts['total']:>14,}{counts['lora']:>14,}"
          f"{counts['lora'] / counts['total']:>12.4%}")
    for key in ("weights", "gradients", "optimizer", "total"):
        label = {"weights": "weights GiB", "gradients": "fp32 grads GiB", "optimizer": "Adam state GiB",
                 "total": "per-rank total GiB"}[key]
        print(f"  {label:<22}{full[key] / gib:>14.2f}{lora[key] / gib:>14.2f}{lora[key] / full[key]:>12.4f}")


if __name__ == "__main__":
    main()
