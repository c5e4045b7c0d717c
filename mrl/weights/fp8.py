"""Blockwise FP8 weights for rollout (`rollout.quantization = "fp8"`): the quantizer, its inverse,
and the weight-stream transform.

Layout (DeepSeek-V3's and vLLM's block-FP8 checkpoint layout, `weight_block_size = [128, 128]`):
a 2-D linear weight `W [m, n]` becomes `W_q [m, n]` in `float8_e4m3fn` and `weight_scale_inv
[ceil(m/128), ceil(n/128)]` in float32, one scale per 128x128 block, with `W ~= W_q * s` block by
block. A block's scale is `s = max(amax, 1e-4) / 448` (448: e4m3's largest finite value), so its
largest element lands on +-448 and nothing saturates; `power_of_two` rounds `s` up to a power of
two (UE8M0 scales, DeepGEMM's on Blackwell), trading up to one bit of range for exact scaling.

The arithmetic is vLLM's reference (`vllm.utils.deep_gemm.per_block_cast_to_fp8` of the pinned
vllm 0.32: amax in float32, `x * (1 / s)` in float32, cast with round-to-nearest-even), so the
bytes are equal to what vLLM's own quantizer makes of the same tensor
(`tests/rollout/test_fp8_vllm_ref.py`), except that the scale divides by a 0-dim tensor rather
than a Python float: CUDA turns the latter into a multiplication by an inexact reciprocal, so this
way the bytes are the same on every device (`tests/gpu/test_fp8_gpu.py`). Round trip: for an element of magnitude |x| in a block of
scale s, e4m3 keeps 3 mantissa bits, so `|x - W_q * s| <= 2**-4 * 2**floor(log2 |x / s|) * s`
(half an ulp) for normal values and `2**-10 * s` (half the subnormal step) below `2**-6 * s`.

What is quantized: 2-D `*.weight` tensors of the stream, except names matching a skip pattern
(`DEFAULT_SKIP`: embeddings, the head, norms, MoE routers). Each quantized weight is followed in
the stream by its `*.weight_scale_inv`; everything else passes unchanged in the export dtype.
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator, Sequence

import torch

BLOCK = (128, 128)
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                 # torch.finfo(torch.float8_e4m3fn).max
AMAX_FLOOR = 1e-4               # an all-zero block still gets a finite scale (vLLM's clamp)
SCALE_SUFFIX = "_scale_inv"     # X.weight -> X.weight_scale_inv
# embeddings, the head, norms, routers (qwen*_moe `mlp.gate`, qwen2_moe `shared_expert_gate`)
DEFAULT_SKIP = ("embed_tokens", "lm_head", "norm", r"\.mlp\.gate\.weight$", "shared_expert_gate")


def quantize_block_fp8(w: torch.Tensor, block: Sequence[int] = BLOCK,
                       power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`(w_q float8_e4m3fn [m, n], scale_inv float32 [ceil(m/bm), ceil(n/bn)])` of a 2-D `w`."""
    if w.dim() != 2:
        raise ValueError(f"blockwise FP8 quantizes 2-D weights, got shape {tuple(w.shape)}")
    m, n = w.shape
    bm, bn = int(block[0]), int(block[1])
    rows, cols = -(-m // bm), -(-n // bn)
    padded = torch.zeros(rows * bm, cols * bn, dtype=w.dtype, device=w.device)
    padded[:m, :n] = w
    view = padded.view(rows, bm, cols, bn)
    amax = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(AMAX_FLOOR)
    # a 0-dim tensor divisor: CUDA divides by a Python scalar as a multiplication by its (inexact)
    # reciprocal, one ulp off in some blocks; tensor / tensor is the correctly rounded division the
    # CPU does for both, so the bytes are the same wherever the export lives
    scale = amax / torch.full((), FP8_MAX, device=amax.device)
    if power_of_two:
        scale = torch.pow(2.0, torch.ceil(torch.log2(scale.abs())))
    q = (view * (1.0 / scale)).to(FP8)
    return q.view(rows * bm, cols * bn)[:m, :n].contiguous(), scale.view(rows, cols)


def dequantize_block_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int] = BLOCK,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`q * scale_inv` block by block, computed in float32 (as vLLM's `block_dequant`), cast to `dtype`."""
    m, n = q.shape
    bm, bn = int(block[0]), int(block[1])
    s = scale_inv.float().repeat_interleave(bm, 0)[:m].repeat_interleave(bn, 1)[:, :n]
    return (q.float() * s).to(dtype)


def e4m3_error_bound(w: torch.Tensor, scale_inv: torch.Tensor, block: Sequence[int] = BLOCK) -> torch.Tensor:
    """Per element, the largest round-trip error e4m3 allows (half an ulp at the element's
    scaled magnitude; half the subnormal step below e4m3's smallest normal, 2**-6)."""
    m, n = w.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:m].repeat_interleave(block[1], 1)[:, :n]
    x = (w.float() / s).abs()
    exp = torch.floor(torch.log2(x.clamp(min=2.0 ** -6)))
    return torch.ldexp(torch.ones_like(x), (exp - 4).to(torch.int32)) * s


class Fp8Stream:
    """Which tensors of a weight stream go as block FP8, and the transform itself."""

    def __init__(self, skip: Sequence[str] = DEFAULT_SKIP, block: Sequence[int] = BLOCK, power_of_two: bool = False):
        self.patterns = [re.compile(p) for p in skip]
        self.block = (int(block[0]), int(block[1]))
        self.power_of_two = power_of_two

    def quantizes(self, name: str, shape: Sequence[int]) -> bool:
        """A 2-D `*.weight` no skip pattern matches."""
        return (len(shape) == 2 and name.endswith(".weight")
                and not any(p.search(name) for p in self.patterns))

    def __call__(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in stream:
            if self.quantizes(name, tensor.shape):
                q, s = quantize_block_fp8(tensor.detach(), self.block, self.power_of_two)
                yield name, q
                yield name + SCALE_SUFFIX, s
            else:
                yield name, tensor

    def nbytes(self, name: str, shape: Sequence[int], elem_bytes: int) -> int:
        """Bytes this tensor takes on the wire (the weight and its scales, or the tensor as is)."""
        numel = 1
        for d in shape:
            numel *= d
        if not self.quantizes(name, shape):
            return numel * elem_bytes
        blocks = -(-shape[0] // self.block[0]) * -(-shape[1] // self.block[1])
        return numel + 4 * blocks

    def ignored_modules(self, names: Iterable[tuple[str, Sequence[int]]]) -> list[str]:
        """Modules of 2-D linear weights the skip list keeps unquantized (vLLM's `ignored_layers`):
        embeddings, the head and norms are never quantized by vLLM's FP8 method, so they are left out."""
        out = []
        for name, shape in names:
            if (len(shape) == 2 and name.endswith(".weight") and not self.quantizes(name, shape)
                    and not re.search(r"embed_tokens|lm_head|norm", name)):
                out.append(name.removesuffix(".weight"))
        return out

    def vllm_config(self, ignored: Sequence[str] = ()) -> dict:
        """The `quantization_config` vLLM's block-FP8 loader reads for this stream."""
        cfg = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
               "weight_block_size": list(self.block)}
        if ignored:
            cfg["ignored_layers"] = list(ignored)
        return cfg


def from_config(rollout) -> "Fp8Stream | None":
    """The stream transform of `rollout.quantization` / `rollout.fp8`, or None when it is off."""
    if rollout.quantization != "fp8":
        return None
    return Fp8Stream(skip=rollout.fp8.skip, power_of_two=rollout.fp8.power_of_two_scales)


TIS_HINT = ("set [algorithm.correction] level = \"token\", mode = \"truncate\", threshold = 2.0 (token TIS at 2.0, "
            "verl's recommendation with FP8 rollout; jobs/quickstart_fp8_cpu.toml)")


def fp8_problems(spec) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(errors, warnings) of a job's FP8 rollout settings, as (key, one line) for `mrl validate`."""
    errors, warnings = [], []
    for pattern in spec.rollout.fp8.skip:
        try:
            re.compile(pattern)
        except re.error as e:
            errors.append(("rollout.fp8.skip", f"{pattern!r} is not a regular expression ({e})"))
    if spec.rollout.quantization == "fp8":
        corr = spec.algorithm.correction
        if corr.level == "off" and corr.preset is None and corr.rejection is None:
            warnings.append(("rollout.quantization", "fp8 rollout adds weight rounding the trainer does not see, and "
                                                     "no rollout correction is set: " + TIS_HINT))
        if spec.rollout.fp8.matmul != "auto" and spec.rollout.engine != "hf":
            warnings.append(("rollout.fp8.matmul", f"applies to the hf engine only; the {spec.rollout.engine} engine "
                                                   "runs its own FP8 kernels"))
    return errors, warnings
