"""Block-FP8 weights in the `hf` engine: the stream's `float8_e4m3fn` weights and their
`weight_scale_inv` are held as they arrived, and the parameter the matmul reads is their
blockwise dequantization (`mrl.weights.fp8.dequantize_block_fp8`: `q * s` in float32, cast to
the engine dtype). The engine thus generates with exactly the weight rounding a block-FP8 engine
holds.

`rollout.fp8.matmul = "scaled_mm"` (the default on CUDA GPUs of compute capability 8.9 or more:
`"auto"`) runs the linear layers as real FP8 GEMMs instead, as vLLM's block-FP8 method does on
such GPUs: activations are quantized per token per 128 columns (`act_quant`), and
`block_fp8_matmul` runs one row-wise-scaled `torch._scaled_mm` per 128-wide K block (FP8 tensor
cores on the GPU; torch's CPU kernel elsewhere), summed in float32. Fused MoE experts are not
`nn.Linear` modules and keep the dequantized path.

The held bytes are what the weight verification reads back (`held_weights`), and sparse
(delta) updates land in them; a weight is dequantized again once per sync when its bytes or
scales changed (`flush`).
"""
from __future__ import annotations

from typing import Optional

import torch

from mrl.weights.fp8 import AMAX_FLOOR, BLOCK, FP8, FP8_MAX, SCALE_SUFFIX, dequantize_block_fp8

MATMULS = ("auto", "dequantized", "scaled_mm")


def scaled_mm_default(device: torch.device) -> bool:
    """`matmul = "auto"`: FP8 GEMMs where FP8 tensor cores are (CUDA, compute capability >= 8.9)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def act_quant(x: torch.Tensor, group: int = BLOCK[1]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, per `group` columns: FP8 activations `[M, K]` and float32 scales `[M, K / group]`."""
    m, k = x.shape
    v = x.float().view(m, k // group, group)
    s = v.abs().amax(-1, keepdim=True).clamp(AMAX_FLOOR) / torch.full((), FP8_MAX, device=x.device)
    return (v / s).to(FP8).view(m, k), s.squeeze(-1)


def block_fp8_matmul(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, block=BLOCK,
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`x @ W.T` for `x [M, K]` and W in block FP8 (`w_q [N, K]`, `w_s [N/128, K/128]`): one
    `_scaled_mm` per K block (its activation scales per row, the weight block scales per output
    column), the partial products summed in float32. K must be a multiple of the block width.
    CUDA's row-wise scaled GEMM writes bf16 only, so there each partial product is rounded to bf16
    once; the CPU kernel writes float32."""
    x_q, x_s = act_quant(x, block[1])
    n, k = w_q.shape
    part_dtype = torch.bfloat16 if x.is_cuda else torch.float32
    out = torch.zeros(x.shape[0], n, dtype=torch.float32, device=x.device)
    for kb in range(k // block[1]):
        cols = slice(kb * block[1], (kb + 1) * block[1])
        scale_b = w_s[:, kb].repeat_interleave(block[0])[:n].reshape(1, n).contiguous()
        part = torch._scaled_mm(x_q[:, cols].contiguous(), w_q[:, cols].t(), scale_a=x_s[:, kb:kb + 1].contiguous(),
                                scale_b=scale_b, out_dtype=part_dtype)
        out += part.float()
    return out.to(out_dtype)


class Fp8Linear:
    """The forward of an `nn.Linear` whose weight is held in block FP8: `block_fp8_matmul` + bias."""

    def __init__(self, linear: torch.nn.Linear, held: "Fp8Held", name: str):
        self.linear, self.held, self.name = linear, held, name

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q, s = self.held.tensors[self.name], self.held.tensors[self.name + SCALE_SUFFIX]
        flat = x.reshape(-1, x.shape[-1])
        out = block_fp8_matmul(flat, q, s, self.held.block, out_dtype=x.dtype)
        if self.linear.bias is not None:
            out = out + self.linear.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


class Fp8Held:
    """name -> held FP8 weight / scale tensors of one engine, and which weights need dequantizing."""

    def __init__(self, block=BLOCK, scaled_mm: bool = False):
        self.block = block
        self.scaled_mm = scaled_mm   # linear layers run FP8 GEMMs on the held bytes (else the dequantized weights)
        self.tensors: dict[str, torch.Tensor] = {}   # X.weight (fp8) and X.weight_scale_inv (float32)
        self.dirty: set[str] = set()
        self.routed: set[str] = set()   # weights whose nn.Linear runs `Fp8Linear`

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

    def route(self, model: torch.nn.Module) -> None:
        """With `scaled_mm`, make every `nn.Linear` whose weight is held run `Fp8Linear` (once each)."""
        if not self.scaled_mm:
            return
        for name in sorted(n for n in self.tensors if not n.endswith(SCALE_SUFFIX) and n not in self.routed):
            try:
                module = model.get_submodule(name.removesuffix(".weight"))
            except AttributeError:   # a view into fused MoE experts: dequantized
                continue
            if isinstance(module, torch.nn.Linear) and module.in_features % self.block[1] == 0:
                module.forward = Fp8Linear(module, self, name)
                self.routed.add(name)

    @torch.no_grad()
    def flush(self, targets: dict[str, torch.Tensor]) -> None:
        """Write the dequantization of every changed weight into its parameter (what the weight
        verification of a `dequantized` engine and MoE experts read; cheap beside a sync)."""
        for name in sorted(self.dirty):
            q, s = self.tensors.get(name), self.tensors.get(name + SCALE_SUFFIX)
            if q is None or s is None:
                raise RuntimeError(f"hf engine: the weight stream sent {name if q is not None else name + SCALE_SUFFIX} "
                                   f"without its {'scales' if q is not None else 'FP8 weight'}")
            target = targets[name]
            target.data.copy_(dequantize_block_fp8(q, s, self.block, dtype=target.dtype))
        self.dirty.clear()
