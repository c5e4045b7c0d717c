"""Block-FP8 weights in the `hf` engine: the stream's `float8_e4m3fn` weights and their
`weight_scale_inv` are held as they arrived, and the parameter the matmul reads is their
blockwise dequantization (`mrl.weights.fp8.dequantize_block_fp8`: `q * s` in float32, cast to
the engine dtype). The engine thus generates with exactly the weight rounding a block-FP8 engine
holds; what it does not reproduce is an FP8 GEMM's activation quantization (vLLM quantizes
activations per 1x128 group on GPUs with FP8 tensor cores), so it is a weight-only FP8 engine.

The held bytes are what the weight verification reads back (`held_weights`), and sparse
(delta) updates land in them; a weight is dequantized again once per sync when its bytes or
scales changed (`flush`).
"""
from __future__ import annotations

from typing import Optional

import torch

from mrl.weights.fp8 import BLOCK, FP8, SCALE_SUFFIX, dequantize_block_fp8


class Fp8Held:
    """name -> held FP8 weight / scale tensors of one engine, and which weights need dequantizing."""

    def __init__(self, block=BLOCK):
        self.block = block
        self.tensors: dict[str, torch.Tensor] = {}   # X.weight (fp8) and X.weight_scale_inv (float32)
        self.dirty: set[str] = set()

    @staticmethod
    def weight_of(name: str) -> str:
        return name.removesuffix(SCALE_SUFFIX)

    def claims(self, name: str, tensor: Optional[torch.Tensor] = None) -> bool:
        """Is `name` an FP8 weight or a scale (one arriving now as `tensor`, or one held)?"""
        if tensor is not None:
            return tensor.dtype == FP8 or name.endswith(SCALE_SUFFIX)
        return name in self.tensors

    def put(self, name: str, tensor: torch.Tensor, device: torch.device) -> str:
        """Hold a whole weight or scale; returns the weight's name."""
        held = self.tensors.get(name)
        if held is not None and held.shape == tensor.shape and held.dtype == tensor.dtype:
            held.copy_(tensor)
        else:
            self.tensors[name] = tensor.detach().to(device, copy=True)
        self.dirty.add(self.weight_of(name))
        return self.weight_of(name)

    def put_sparse(self, name: str, indices: torch.Tensor, values: torch.Tensor) -> None:
        held = self.tensors[name]
        ints = torch.uint8 if held.dtype == FP8 else None
        flat = (held.view(ints) if ints else held).view(-1)
        vals = values.view(ints) if ints else values
        flat[indices.to(flat.device, torch.int64)] = vals.to(flat.device)
        self.dirty.add(self.weight_of(name))

    @torch.no_grad()
    def flush(self, targets: dict[str, torch.Tensor]) -> None:
        """Write the dequantization of every changed weight into its parameter."""
        for name in sorted(self.dirty):
            q, s = self.tensors.get(name), self.tensors.get(name + SCALE_SUFFIX)
            if q is None or s is None:
                raise RuntimeError(f"hf engine: the weight stream sent {name if q is not None else name + SCALE_SUFFIX} "
                                   f"without its {'scales' if q is not None else 'FP8 weight'}")
            target = targets[name]
            target.data.copy_(dequantize_block_fp8(q, s, self.block, dtype=target.dtype))
        self.dirty.clear()
