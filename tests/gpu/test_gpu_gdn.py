"""The GPU tier for the Qwen3-Next / Qwen3.5 hybrids: fla's chunked gated delta rule (Triton, the
kernel `mrl.platform.delta_rule` runs on CUDA) against mrl's torch twin on packed rows, the chunked
twin on CUDA tensors (what runs without fla) against itself on CPU, and a tiny
qwen3_next through megatron on CUDA against transformers' float32 logits. Skipped without CUDA (and
the kernel test without `fla`, the `gpu` extra's fla-core); never run on the CPU machines the
hybrids were built on."""
from __future__ import annotations

import json

import pytest
import torch

from tests.gpu.test_gpu import cuda_platform  # noqa: F401 - the module fixture
from tests.weights.archs import make_hf_model, probe_tokens

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU tier needs CUDA")]


def test_fla_kernel_equals_the_twin_on_packed_rows():
    """Sequences of 130, 64, 7 and 1 tokens in one row (2 key heads serving 4 value heads of 64):
    fla's kernel with cu_seqlens equals the twin within 1e-4 in float32 and 2e-2 in bf16."""
    from mrl.platform.delta_rule import fla_kernel, gated_delta_rule, kernel_name, recurrent_twin

    if fla_kernel() is None:
        pytest.skip("fla (fla-core) is not installed")
    assert kernel_name("cuda") == "fla"
    lengths = [130, 64, 7, 1]
    total = sum(lengths)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(total, 2, 64, generator=g) for _ in range(2))
    v = torch.randn(total, 4, 64, generator=g)
    decay, beta = -torch.rand(total, 4, generator=g) * 2, torch.rand(total, 4, generator=g)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    want = recurrent_twin(q, k, v, decay, beta, cu)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        got = gated_delta_rule(*(x.cuda().to(dtype) for x in (q, k, v)), decay.cuda(), beta.cuda().to(dtype),
                               cu.cuda())
        assert (got.float().cpu() - want).abs().max().item() <= tol, dtype


def test_the_chunked_twin_runs_on_cuda():
    """CUDA without fla runs the chunked twin on CUDA tensors: sequences of 130, 64, 7 and 1 tokens
    (2 key heads serving 4 value heads of 64) equal the twin on CPU within 1e-5 in float32, and
    the gradients of q, k, v, g and beta within 1e-5 of the largest."""
    from mrl.platform.delta_rule import chunked_twin

    lengths = [130, 64, 7, 1]
    total = sum(lengths)
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(total, 2, 64, generator=g), torch.randn(total, 2, 64, generator=g),
              torch.randn(total, 4, 64, generator=g), -torch.rand(total, 4, generator=g) * 2,
              torch.rand(total, 4, generator=g)]
    weight = torch.randn(total, 4, 64, generator=g)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    results = []
    for device in ("cpu", "cuda"):
        xs = [x.to(device).requires_grad_() for x in inputs]
        out = chunked_twin(*xs, cu.to(device))
        (out * weight.to(device)).sum().backward()
        results.append([out.detach().cpu()] + [x.grad.cpu() for x in xs])
    for name, want, got in zip("out q k v g beta".split(), *results):
        assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item()), name


def test_qwen3_next_matches_transformers_on_cuda(cuda_platform, tmp_path):  # noqa: F811
    """tiny qwen3_next (archs.py) on CUDA through megatron (varlen attention, fla or the twin for the
    DeltaNet) against transformers' float32 CPU logits on 80 tokens: within 1e-4."""
    from transformers import AutoModelForCausalLM

    from mrl.models.megatron import build_gpt, complete_hf_config, position_ids, transformer_config
    from mrl.platform.config import ParallelConfig
    from mrl.weights import load_hf_checkpoint

    ref = make_hf_model("qwen3_next", tmp_path).eval()
    hf = complete_hf_config(json.loads((tmp_path / "config.json").read_text()))
    config = transformer_config(hf, dtype="float32", parallel=ParallelConfig(), device="cuda")
    model = build_gpt(hf, config).cuda().eval()
    load_hf_checkpoint([model], tmp_path, hf)
    tokens = probe_tokens(hf["vocab_size"], seq=80)
    with torch.no_grad():
        want = ref(tokens).logits
        got = model(tokens.cuda(), position_ids(*tokens.shape, device="cuda"), None)[..., : hf["vocab_size"]]
    assert (got.cpu() - want).abs().max().item() <= 1e-4
