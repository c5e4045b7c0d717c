"""The GPU tier's FP8 rollout checks (`make gpu-check` runs tests/gpu). Skipped without CUDA.
Passed on an H200 (sm90, torch 2.11.0+cu130): 3 tests in 18 s, with the GEMM then written in this
file; the engine's FP8-GEMM path (`rollout.fp8.matmul`, the last checks of the third test) was
added after the session's GPU time ran out and has run on the CPU only.

- the blockwise quantizer on a CUDA tensor makes the same bytes and scales as on the CPU (with a
  Python-scalar divisor CUDA's scales came out one ulp off in some blocks, and elements on a
  rounding tie, x / s = 152, went to 144 instead of 160: 10,251 of 4.2M bytes on an H200);
- the hf engine's FP8 GEMM (`mrl.rollout.hf_fp8.block_fp8_matmul`: `torch._scaled_mm` on sm89+,
  float8_e4m3fn tensor cores) with the stream's 128x128 weight blocks and vLLM's 1x128 activation
  groups, one scaled GEMM per 128-wide K block with row-wise scales: equal, up to bf16 rounding of
  each partial product, to the same product of the dequantized operands in fp32, and within FP8's
  error of the bf16 product;
- the hf engine on CUDA takes a block-FP8 stream through the checksummed channel (the device's
  wsum32 checksums over fp8 bytes), verified by reading the bytes back, delta equal to full, runs
  its linear layers as FP8 GEMMs (`rollout.fp8.matmul = "auto"` on sm89+) and stays close to the
  dequantized engine.
"""
from __future__ import annotations

import pytest
import torch

from mrl.rollout.hf_fp8 import act_quant, block_fp8_matmul
from mrl.weights.fp8 import dequantize_block_fp8, quantize_block_fp8

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


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 tensor cores need sm89 or newer")   # without CUDA: the module's skip says so
def test_a_real_fp8_gemm_on_the_streams_blocks_equals_the_dequantized_product():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 1024, device="cuda", generator=g, dtype=torch.bfloat16)
    w = (torch.randn(768, 1024, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    w_q, w_s = quantize_block_fp8(w)
    got = block_fp8_matmul(x, w_q, w_s, out_dtype=torch.float32)
    x_q, x_s = act_quant(x)
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
    fp8_cores = torch.cuda.get_device_capability() >= (8, 9)
    assert all(e._fp8.scaled_mm == fp8_cores for e in engines)   # fp8_matmul = "auto": FP8 GEMMs there
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

    assert len(engines[0]._fp8.routed) == (14 if fp8_cores else 0)   # q, k, v, o, gate, up, down x 2 layers
    out = engines[0].generate([[1, 5, 6]], Sampling(n=2, temperature=1.0, max_tokens=4, seed=0))
    assert all(len(r.token_ids) == 4 for r in out)
    deq = HFEngine.from_config(BUILTIN_PRESETS["tiny-llama"], dtype="bfloat16", device="cuda", fp8_matmul="dequantized")
    ColocatedChannel(deq).push(Fp8Stream()((n, w.to(torch.bfloat16)) for n, w in master.items()), 0)
    seqs = [[1, 5, 6, 7, 8, 9, 10], [1, 300, 301, 2]]
    a, b = engines[0].sequence_logprobs(seqs), deq.sequence_logprobs(seqs)
    diff = max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    print(f"FP8 GEMM engine vs dequantized engine: max |log-prob diff| {diff:.2e}")
    assert diff < 0.05 and (diff > 0 or not fp8_cores)
