"""The GPU tier (`make test-gpu`): what only a CUDA machine can check. Skipped without CUDA.

- the engine in bf16 on CUDA: every available attention backend (`varlen`, `flex`, `te` when
  installed) against megatron's dense-mask reference and against the per-sequence `sdpa` path;
- packed RoPE on CUDA tensors equal to megatron's per-sequence path, with no host synchronisation;
- `mrl train` of the quickstart on one GPU in bf16 for 20 steps with checkpoints, a resume whose
  every step logs what the uninterrupted run logged, and `mrl merge` of the result;
- a smoke run of every benchmark on CUDA.

The Triton kernels' own GPU tests are `tests/kernels` (real Triton on CUDA tensors); `make
test-gpu` runs both. On a GPU machine without MLflow, runs use the console tracker only.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_util import REPO, free_port, repo_pythonpath

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU tier needs CUDA")]


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": repo_pythonpath(), "MASTER_PORT": str(free_port()), **extra}


@pytest.fixture(scope="module")
def cuda_platform():
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        os.environ.setdefault(k, v)
    from mrl import platform
    from mrl.platform.config import ParallelConfig, PlatformConfig

    with platform.setup(PlatformConfig(device="cuda", ranks_per_node=1), ParallelConfig(), seed=5):
        yield


HF = dict(model_type="qwen2", vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
          num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=False)


def _model(dtype: str, attention: str):
    from mrl.models.megatron import build_gpt, transformer_config
    from mrl.platform.config import ParallelConfig

    cfg = transformer_config(HF, dtype=dtype, parallel=ParallelConfig(), device="cuda", attention=attention)
    return build_gpt(HF, cfg, attention=attention).cuda()


def _run(model, lengths, dense: bool):
    from mrl.engine.packing import _thd_params
    from mrl.models.tiny_model import block_causal_mask

    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, HF["vocab_size"], (1, sum(lengths)), generator=g).cuda()
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).cuda()
    if dense:
        out = model(tokens, pos, block_causal_mask(lengths).cuda())
    else:
        out = model(tokens, pos, None, packed_seq_params=_thd_params(lengths, "cuda"))
    out.float().square().mean().backward()
    return out.float(), {n: p.main_grad if hasattr(p, "main_grad") else p.grad for n, p in model.named_parameters()}


def _backends() -> list[str]:
    from mrl.models.attention import te_available

    return ["varlen", "flex", "sdpa"] + (["te"] if te_available() else [])


@pytest.mark.parametrize("backend", _backends())
def test_bf16_backends_match_the_dense_reference(cuda_platform, backend):
    """bf16 on CUDA: logits within bf16 rounding of megatron's dense-mask path (fp32 reference
    weights cast to bf16; tolerances are bf16's, stated here)."""
    torch.manual_seed(0)
    ref = _model("bfloat16", "reference")
    mine = _model("bfloat16", backend)
    if backend != "te":  # TE names its parameters differently; the weights stay random there
        mine.load_state_dict(ref.state_dict())
    lengths = [300, 17, 1024, 5, 700]
    want, want_g = _run(ref, lengths, dense=True)
    got, got_g = _run(mine, lengths, dense=False)
    if backend == "te":
        assert torch.isfinite(got).all()
        return
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    for n, g in got_g.items():
        assert torch.allclose(g.float(), want_g[n].float(), rtol=0.05, atol=0.05 * want_g[n].abs().max().item()), n


def _mrl(*args, timeout=900) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "mrl", *args], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rope_matches_megatrons_thd_rope_on_cuda_without_host_syncs(dtype):
    """mrl's packed RoPE on CUDA tensors: equal to megatron's per-sequence `thd` RoPE (the same
    roundings), and positions, tables and rotation never wait for the device."""
    from mrl.models.rope import packed_positions, per_sequence_rope_reference, rope_tables, rotate

    lengths = [300, 1, 17, 1, 1024, 5, 700]
    t, dim = sum(lengths), 128
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, dim, 2, device="cuda", dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(max(lengths), device="cuda", dtype=torch.float32), inv_freq)
    freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    x = torch.randn(t, 8, dim, device="cuda", dtype=dtype)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = rotate(x, *rope_tables(freqs, packed_positions(cu, t), dtype))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = per_sequence_rope_reference(x, cu, freqs)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2 * want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= tolerance


# A plain console line: "step 11/20  reward 0.4531  approx_kl 0.001234  0.21s/step  eta 0:00:02".
STEP_LINE = re.compile(r"^step (\d+)/\d+  (.*?)  [\d.]+s/step", re.M)


def step_headlines(stdout: str) -> dict[int, str]:
    """step -> the console's headline metrics of that step (reward, KL; 4 significant digits)."""
    return {int(m.group(1)): m.group(2) for m in STEP_LINE.finditer(stdout)}


def quickstart_job(out: Path, device: str = "cuda") -> list[str]:
    return ["jobs/quickstart_cpu.toml", f"platform.device={device}", "platform.ranks_per_node=1", "parallel.tensor=1",
            "model.dtype=bfloat16", "tracking.backends=[\"console\"]", "checkpoint.every_steps=10",
            "checkpoint.keep_last=2", f"job.output_dir={out}", "job.name=run"]


def test_quickstart_trains_20_bf16_steps_on_cuda_resumes_and_merges(tmp_path):
    """20 bf16 steps on cuda with the HF engine, uninterrupted and stopped at 10 + resumed: the
    resumed run logs the same headline metrics at every step (the console's; no MLflow on a bare
    GPU box), keeps both checkpoints, and merges to a Hugging Face directory."""
    whole = step_headlines(_mrl("train", *quickstart_job(tmp_path / "whole"), "trainer.total_steps=20").stdout)
    job = quickstart_job(tmp_path)
    first = step_headlines(_mrl("train", *job, "trainer.total_steps=10").stdout)
    again = step_headlines(_mrl("train", *job, "trainer.total_steps=20").stdout)
    assert sorted(whole) == list(range(1, 21)) and sorted(first) == list(range(1, 11)), (whole, first)
    assert {**first, **again} == whole, ({**first, **again}, whole)
    ckpts = sorted(p.name for p in (tmp_path / "run/checkpoints/actor").glob("step_*"))
    assert ckpts == ["step_00000010", "step_00000020"], ckpts
    out = tmp_path / "hf"
    _mrl("merge", str(tmp_path / "run/checkpoints/actor"), str(out))
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"


def _bench(script: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(REPO / "tools/bench" / script), *args], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_train_step_benchmark_reports_mfu_on_cuda():
    out = _bench("train_step.py", "--device", "cuda", "--shape", "370m", "--steps", "1", "--responses", "16")
    assert re.search(r"MFU [\d.]+%", out), out


def test_kernel_weight_and_rollout_benchmarks_run_on_cuda():
    assert re.search(r"%HBM", _bench("kernels.py", "--iters", "2", "--warmup", "1"))
    _bench("weights.py", "--device", "cuda", "--dtype", "bf16", "--layers", "2", "--iters", "1")
    assert re.search(r"ratio megatron / mrl", _bench("rope.py", "--iters", "2", "--warmup", "1"))
    if __import__("importlib").util.find_spec("vllm") is not None:
        _bench("rollout.py")
