"""The GPU tier for issue 40's attention variants: gpt-oss (sinks, sliding windows) and Gemma 3's
text model (sliding windows with a local RoPE base, sandwich norms) on CUDA, through every
attention backend there: `sdpa` (mrl's torch twin for windows and sinks), `varlen` (windows in
torch's flash kernel, sinks in the twin) and `te` when installed (megatron's Transformer Engine
spec: `softmax_type = "learnable"`, `window_size`, TE's zero-centred-gamma norms). Skipped without
CUDA; never run on the CPU machines these types were built on.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.gpu.test_gpu import cuda_platform  # noqa: F401 - the module fixture
from tests.weights.archs import make_hf_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU tier needs CUDA")]


def _backends() -> list[str]:
    from mrl.models.attention import te_available

    return ["sdpa", "varlen"] + (["te"] if te_available() else [])


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("arch", ["gpt_oss", "gemma3_text"])
def test_windows_and_sinks_match_transformers_on_cuda(cuda_platform, tmp_path, arch, backend):  # noqa: F811
    """A 48-token sequence (12 windows of gpt-oss' 4, past yarn's original 32 positions) through
    megatron on CUDA against transformers' float32 logits on the same weights: within 1e-4 in
    float32 (`sdpa`), within bf16 rounding (5% of the largest logit) in bf16 for every backend."""
    from transformers import AutoModelForCausalLM

    from mrl.models.megatron import build_gpt, complete_hf_config, position_ids, transformer_config
    from mrl.platform.config import ParallelConfig
    from mrl.weights import load_hf_checkpoint

    make_hf_model(arch, tmp_path)
    hf = complete_hf_config(json.loads((tmp_path / "config.json").read_text()))
    tokens = torch.randint(0, hf["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()(tokens).logits.cuda()
    for dtype in (["float32"] if backend == "sdpa" else []) + ["bfloat16"]:
        cfg = transformer_config(hf, dtype=dtype, parallel=ParallelConfig(), device="cuda", attention=backend)
        model = build_gpt(hf, cfg, attention=backend).cuda().eval()
        load_hf_checkpoint([model], tmp_path, hf)
        with torch.no_grad():
            got = model(tokens.cuda(), position_ids(*tokens.shape, device="cuda"), None)[..., : hf["vocab_size"]]
        diff = (got.float() - want).abs().max().item()
        bound = 1e-4 if dtype == "float32" else 0.05 * want.abs().max().item()
        assert diff <= bound, (arch, backend, dtype, diff)
