"""The GPU tier's FP8 rollout checks (`make gpu-check` runs tests/gpu). Skipped without CUDA.
Passed on an H200 (sm90, torch 2.11.0+cu130): 3 tests in 18 s.

- the blockwise quantizer on a CUDA tensor makes the same bytes and scales as on the CPU (with a
  Python-scalar divisor CUDA's scales came out one ulp off in some blocks, and elements on a
  rounding tie, x / s = 152, went to 144 instead of 160: 10,251 of 4.2M bytes on an H200);
- a real FP8 GEMM (`torch._scaled_mm` on sm89+, float8_e4m3fn tensor cores) with the stream's
  128x128 weight blocks and vLLM's 1x128 activation groups, one scaled GEMM per 128-wide K block
  with row-wise scales: equal, up to bf16 output rounding, to the same product of the
  dequantized operands in fp32, and within FP8's error of the bf16 product;
- the hf engine on CUDA takes a block-FP8 stream through the checksummed channel (the device's
  wsum32 checksums over fp8 bytes), verified by reading the bytes back, and delta equals full.
"""
from __future__ import annotations

import pytest
import torch

from mrl.weights.fp8 import BLOCK, FP8, FP8_MAX, dequantize_block_fp8, quantize_block_fp8

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU tier needs CUDA")]


def test_the_quantizer_makes_the_same_bytes_on_cuda_as_on_cpu():
    g = torch.Generator().manual_seed(0)
    for shape in [(4096, 1024), (300, 200)]:
        w = (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
        for pow2 in (False, True):
            q, s = quantize_block_fp8(w, power_of_two=pow2)
            qc, sc = quantize_block_fp8(w.cuda(), power_of_two=pow2)
            assert torch.equal(qc.cpu().view(torch.uint8), q.view(torch.uint8)) and torch.equal(sc.cpu(), s)


def _act_quant(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, per 128-column group: FP8 activations and their float32 scales [M, K/128]."""
    m, k = x.shape
    v = x.float().view(m, k // group, group)
    s = v.abs().amax(-1, keepdim=True).clamp(1e-4) / FP8_MAX
    return (v / s).to(FP8).view(m, k), s.squeeze(-1)


def block_fp8_matmul(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor) -> torch.Tensor:
    """`x @ W.T` with W in block FP8, on FP8 tensor cores: one `_scaled_mm` per K block (its
    activation scales per row, the weight block scales per output column), summed in fp32."""
    x_q, x_s = _act_quant(x)
    n, k = w_q.shape
    out = torch.zeros(x.shape[0], n, dtype=torch.float32, device=x.device)
    for kb in range(k // BLOCK[1]):
        cols = slice(kb * BLOCK[1], (kb + 1) * BLOCK[1])
        scale_b = w_s[:, kb].repeat_interleave(BLOCK[0])[:n].reshape(1, n).contiguous()
        part = torch._scaled_mm(x_q[:, cols].contiguous(), w_q[:, cols].t(), scale_a=x_s[:, kb:kb + 1].contiguous(),
                                scale_b=scale_b, out_dtype=torch.bfloat16)
        out += part.float()
    return out


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 tensor cores need sm89 or newer")
def test_a_real_fp8_gemm_on_the_streams_blocks_equals_the_dequantized_product():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 1024, device="cuda", generator=g, dtype=torch.bfloat16)
    w = (torch.randn(768, 1024, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    w_q, w_s = quantize_block_fp8(w)
    got = block_fp8_matmul(x, w_q, w_s)
    x_q, x_s = _act_quant(x)
    x_dq = (x_q.float().view(64, 8, 128) * x_s[..., None]).view(64, 1024)
    ref = x_dq @ dequantize_block_fp8(w_q, w_s).t()
    # each K block's partial product is rounded to bf16 once (8 blocks): relative 2**-8 of its size
    assert (got - ref).abs().max() <= 8 * 2 ** -8 * ref.abs().max()
    exact = x.float() @ w.float().t()
    rel = (got - exact).norm() / exact.norm()
    assert 0 < rel < 0.05, rel   # FP8's rounding of weights and activations, a few percent at most


def test_the_hf_engine_on_cuda_takes_a_checksummed_fp8_stream_and_delta_equals_full():
    pytest.importorskip("transformers")
    from mrl.models.facts import BUILTIN_PRESETS
    from mrl.rollout.hf import HFEngine
    from mrl.rollout.weight_channel import ColocatedChannel
    from mrl.weights.fp8 import Fp8Stream
    from mrl.weights.verify import same_bits

    engines = [HFEngine.from_config(BUILTIN_PRESETS["tiny-llama"], dtype="bfloat16", device="cuda") for _ in range(2)]
    full = ColocatedChannel(engines[0], mode="full", verify_every_steps=1)
    delta = ColocatedChannel(engines[1], mode="delta", verify_every_steps=1)
    g = torch.Generator(device="cuda").manual_seed(1)
    master = {n: torch.randn(p.shape, device="cuda", generator=g) * 0.05
              for n, p in engines[0].model.named_parameters()}
    for step in range(5):
        if step:
            for w in master.values():
                w.add_(torch.randn(w.shape, device="cuda", generator=g).sign() * 1e-3 * w.abs())
        for channel in (full, delta):
            channel.push(Fp8Stream()((n, w.to(torch.bfloat16)) for n, w in master.items()), step, lost=step == 0)
            assert channel.last.verified
        a, b = engines[0]._fp8.tensors, engines[1]._fp8.tensors
        assert a.keys() == b.keys() and all(same_bits(a[n], b[n]).all() for n in a)
        assert next(iter(a.values())).device.type == "cuda"
    from mrl.rollout.types import Sampling

    out = engines[0].generate([[1, 5, 6]], Sampling(n=2, temperature=1.0, max_tokens=4, seed=0))
    assert all(len(r.token_ids) == 4 for r in out)
