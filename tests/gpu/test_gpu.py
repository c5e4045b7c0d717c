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


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 4e-3), (torch.bfloat16, 3e-2)])
def test_context_parallel_varlen_attention_matches_causal_attention_on_cuda(dtype, tol):
    """The CUDA kernel of context parallelism (`varlen` with each query chunk against its key
    prefix: flash's causal mask bottom-right aligned), every CP rank of N = 2 and 4 simulated
    with the whole K/V: rows and gradients equal causal attention per sequence (fp32 dense SDPA)."""
    from mrl.models import context_parallel as CP

    torch.manual_seed(0)
    for n in (2, 4):
        lengths = [CP.padded_length(x, n) for x in (40, 333, 7, 1024)]
        total = sum(lengths)
        q = torch.randn(total, 8, 64, device="cuda", dtype=dtype)
        k = torch.randn(total, 2, 64, device="cuda", dtype=dtype)
        v = torch.randn(total, 2, 64, device="cuda", dtype=dtype)
        q32, k32, v32 = (x.float().requires_grad_() for x in (q, k, v))
        ref = CP.reference_attention(q32, k32, v32, lengths, 0.125)
        g = torch.randn_like(ref)
        dq, dk, dv = torch.autograd.grad((ref * g).sum(), (q32, k32, v32))
        out, gq = torch.zeros_like(ref), torch.zeros_like(q32)
        gk, gv = torch.zeros_like(k32), torch.zeros_like(v32)
        for r in range(n):
            lay = CP.layout(lengths, n, r).to("cuda")
            qs = q[lay.index].detach().requires_grad_()
            ks, vs = k.detach().clone().requires_grad_(), v.detach().clone().requires_grad_()
            o = CP._varlen_cp(qs, ks, vs, lay, 0.125)
            out[lay.index] = o.detach().float()
            a, b, c = torch.autograd.grad((o.float() * g[lay.index]).sum(), (qs, ks, vs))
            gq[lay.index] = a.float()
            gk += b.float()
            gv += c.float()
        for name, got, want in (("out", out, ref), ("dq", gq, dq), ("dk", gk, dk), ("dv", gv, dv)):
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err <= tol, (n, name, err)


def test_bf16_context_parallel_varlen_rounds_as_the_whole_sequence_call_on_cuda():
    """The CUDA counterpart of tests/engine/test_context_parallel.py's bf16 rounding test. CP2's
    `varlen` kernel (each query chunk against its key prefix, K/V rows in float32 cast for the
    kernel) against CP1's `varlen_packed`: the output and dq come from the same flash kernel over
    the same keys, so under 1% of them differ (flash sums dq with float32 atomics, in no fixed
    order), by at most one bf16 ulp of the largest value. dK/dV leave the bf16-only kernel rounded once per query chunk
    before the float32 sum over chunks and ranks, a rounding CP1 does not have: their distance to
    float32 attention is bounded at 1.5x CP1's instead."""
    from mrl.models import context_parallel as CP
    from mrl.models.attention import varlen_packed

    torch.manual_seed(0)
    n, dt = 2, torch.bfloat16
    lengths = [CP.padded_length(x, n) for x in (40, 333, 7, 1024)]
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, 64, device="cuda", dtype=dt, requires_grad=True) for h in (8, 2, 2))
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0)
    cp1 = varlen_packed(q, k, v, cu, max(lengths), 0.125)
    g = torch.randn_like(cp1)
    want = [cp1.detach(), *torch.autograd.grad((cp1 * g).sum(), (q, k, v))]
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = CP.reference_attention(q32, k32, v32, lengths, 0.125)
    exact = [ref.detach(), *torch.autograd.grad((ref * g.float()).sum(), (q32, k32, v32))]
    out, dq = torch.zeros_like(q), torch.zeros_like(q)
    dk, dv = torch.zeros(k.shape, device="cuda"), torch.zeros(v.shape, device="cuda")   # the ranks' float32 sum
    for r in range(n):
        lay = CP.layout(lengths, n, r).to("cuda")
        qs = q.detach()[lay.index].requires_grad_()
        ks, vs = k.detach().float().requires_grad_(), v.detach().float().requires_grad_()
        o = CP._varlen_cp(qs, ks, vs, lay, 0.125)
        out[lay.index] = o.detach()
        a, b, c = torch.autograd.grad((o * g[lay.index]).sum(), (qs, ks, vs))
        dq[lay.index] = a
        dk += b
        dv += c
    got = [out, dq, dk.to(dt), dv.to(dt)]
    for name, x, w in list(zip(("out", "dq"), got, want)):
        differ = (x != w).float().mean().item()
        worst = ((x.float() - w.float()).abs().max() / w.float().abs().max()).item()
        assert differ < 0.01 and worst <= 2 ** -7, (name, differ, worst)   # one ulp at the largest value
    rms = lambda a, b: ((a.float() - b) ** 2).mean().sqrt().item()   # noqa: E731
    for name, x, w, e in list(zip(("out", "dq", "dk", "dv"), got, want, exact))[2:]:
        assert rms(x, e) <= 1.5 * rms(w, e), (name, rms(x, e), rms(w, e))


def test_tensor_2_x_context_2_and_pipeline_2_x_context_2_on_four_ranks_equal_one_naive_call():
    """TP2 x CP2 and PP2 x CP2 (4 gloo ranks on the GPU machine's CPU cores; the CPU CI machine has
    2, where the launch took 42 s): eval log-probs, loss and every gradient shard equal one naive
    whole-batch call (scripts/cp_tp_equivalence.py)."""
    import re

    from tests.dist_util import run_torchrun

    proc = run_torchrun(REPO / "tests" / "engine" / "scripts" / "cp_tp_equivalence.py", nproc=4, timeout=600)
    diffs = {m.group(1): float(m.group(2)) for m in re.finditer(r"^MAXDIFF (\S+) (\S+)$", proc.stdout, re.M)}
    expect = {f"{layout}_cp2_eval_logprobs": 1e-5 for layout in ("tp2", "pp2")}
    expect.update({f"{layout}_cp2_mb{k}_{w}": 1e-6 for layout in ("tp2", "pp2") for k in (1, 3) for w in ("grads", "loss")})
    assert set(diffs) == set(expect), proc.stdout
    assert all(diffs[k] <= v for k, v in expect.items()), diffs


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


# ----------------------------------------------------------------------------------------------
# Weight sync on CUDA: delta vs full, checksums computed on the device and verified.
# ----------------------------------------------------------------------------------------------

def test_delta_sync_from_cuda_masters_into_the_hf_engine_on_cuda_is_bit_identical_and_verified():
    """fp32 master weights on CUDA, exported in bf16 each step after an Adam-sized update, synced
    into two HF engines on CUDA, one full and one delta: bit-identical after every one of 12
    steps; every checksum is the device algorithm (wsum32, the Triton kernel), every 4th sync is a
    full verification; a tensor that drifts inside the engine is caught by the next verification."""
    from mrl.models.facts import BUILTIN_PRESETS
    from mrl.rollout.hf import HFEngine
    from mrl.rollout.weight_channel import ColocatedChannel
    from mrl.weights import verify
    from mrl.weights.verify import WeightSyncError, default_algorithm, same_bits

    def engine(seed):
        torch.manual_seed(seed)
        return HFEngine.from_config(BUILTIN_PRESETS["tiny-llama"], dtype="bfloat16", device="cuda")

    full_engine, delta_engine = engine(0), engine(1)
    g = torch.Generator(device="cuda").manual_seed(1)
    master = {n: torch.randn(p.shape, generator=g, device="cuda") * 0.05
              for n, p in full_engine.model.named_parameters()}
    stream = lambda: ((n, w.to(torch.bfloat16)) for n, w in master.items())   # noqa: E731
    assert default_algorithm(next(iter(master.values()))) == "wsum32" and verify._kernel() is not None
    full = ColocatedChannel(full_engine, mode="full", bucket_mb=0.05, verify_every_steps=4)
    delta = ColocatedChannel(delta_engine, mode="delta", bucket_mb=0.05, verify_every_steps=4)
    for step in range(12):
        full.push(stream(), step, lost=step == 0)
        delta.push(stream(), step, lost=step == 0)
        a = dict(full_engine.model.named_parameters())
        for n, p in delta_engine.model.named_parameters():
            assert p.is_cuda and same_bits(a[n], p).all(), (step, n)
        if step:
            assert not delta.last.full and 0 < delta.last.bytes_sent < full.last.bytes_sent, (step, delta.last)
        for w in master.values():
            w.add_(torch.randn(w.shape, generator=g, device="cuda").sign() * 1e-4 * w.abs())
    assert full.last.verified and delta.last.verified    # sync 12 was a full verification
    delta.push(stream(), 12)   # sync 13 carries the last update; from here on nothing changes
    with torch.no_grad():
        delta_engine.model.model.layers[1].mlp.up_proj.weight.view(-1)[0] += 1
    for step in (13, 14, 15):   # syncs 14, 15, 16: the 16th verifies
        try:
            delta.push(stream(), step)
        except WeightSyncError as e:
            assert "model.layers.1.mlp.up_proj.weight" in str(e) and step == 15, (step, e)
            break
    else:
        raise AssertionError("the drifted engine tensor was not caught by a verification sync")


def test_a_buckets_wsum32_checksums_are_one_launch_equal_to_the_per_tensor_kernels_and_catch_damage(monkeypatch):
    """`checksum_many` on CUDA (one batched kernel launch and one host read for a bucket) equals
    the per-tensor Triton sums and the torch twin's on a host copy, for whole tensors of several
    dtypes and sizes, a view off word alignment, a sparse (values, indices) payload and an empty
    tensor; a flipped byte and two swapped words change the sum of the tensor they hit only; a
    bucket with a flipped byte in transit is refused by the receiver naming that tensor."""
    from mrl.weights import verify
    from mrl.weights.delta import Bucket, End, Item
    from mrl.rollout.weight_channel import WeightReceiver
    from mrl.weights.verify import WeightSyncError, checksum, checksum_many

    g = torch.Generator(device="cuda").manual_seed(0)
    big = torch.randn(3 * 8192 + 5, generator=g, device="cuda")
    payloads = [(torch.randn(n, generator=g, device="cuda").to(dt),) for n, dt in
                ((7, torch.bfloat16), (8192, torch.float32), (70001, torch.bfloat16), (576, torch.float32))]
    payloads += [(big.view(torch.uint8)[2:],), (big[:100], torch.arange(100, dtype=torch.int32, device="cuda")),
                 (torch.empty(0, device="cuda"),)]
    launches, real = [], verify._kernel_many()
    monkeypatch.setattr(verify, "_kernel_many", lambda: (lambda *a: launches.append(1) or real(*a)))
    sums = checksum_many(payloads)
    assert len(launches) == 1
    assert sums == [checksum(*p) for p in payloads] == [checksum(*(t.cpu() for t in p), algorithm="wsum32")
                                                        for p in payloads]
    flipped = [tuple(t.clone() for t in p) for p in payloads]
    flipped[2][0].view(torch.uint8)[12345] ^= 0x10
    swapped = [tuple(t.clone() for t in p) for p in payloads]
    w = swapped[1][0].view(torch.int32)
    w[[4000, 4001]] = w[[4001, 4000]].clone()
    for bad, k in ((flipped, 2), (swapped, 1)):
        got = checksum_many(bad)
        assert [i for i in range(len(payloads)) if got[i] != sums[i]] == [k]
    items = [Item(f"t{i}", tuple(p[0].shape), p[0], checksum=s) for i, (p, s) in enumerate(zip(flipped, sums))
             if len(p) == 1]
    with pytest.raises(WeightSyncError, match=r"t2 \(version 3, bucket 0\) failed its checksum"):
        WeightReceiver(None, "0").apply([Bucket(3, 0, items), End(3, [[it.name for it in items]], True)], 3, full=True)


# ----------------------------------------------------------------------------------------------
# Routing replay R3 with the HF engine on a tiny MoE, on CUDA.
# ----------------------------------------------------------------------------------------------

def tensorboard_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """metric -> {step: value} from the run's TensorBoard event files (no MLflow on a bare GPU box)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for events in sorted((run_dir / "tensorboard").rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def test_routing_replay_r3_with_the_hf_engine_on_a_tiny_moe_on_cuda(tmp_path):
    """`mrl train` of the MoE quickstart (tiny Qwen3-MoE, 4 experts top 2) on one GPU in bf16 with
    the HF engine on CUDA, with `actor.moe.routing_replay` off and r3 (same seed, so step 1 has the
    same rollouts): both run; the trainer's own top-k agrees with the engine's on at least 95% of
    (token, layer) pairs on step 1 (bf16 near-ties differ; fp32 CPU runs agree exactly, in
    tests/train); and replaying the engine's routes does not raise the step-1 train/rollout
    log-prob mismatch above the run that lets megatron route by itself."""
    pytest.importorskip("tensorboard")
    runs = {}
    for mode in ("off", "r3"):
        _mrl("train", "jobs/quickstart_moe_cpu.toml", "platform.device=cuda", "platform.ranks_per_node=1",
             "parallel.tensor=1", "parallel.expert=1", "model.dtype=bfloat16",
             "tracking.backends=[\"console\",\"tensorboard\"]", "checkpoint.every_steps=0",
             "trainer.total_steps=2", f"actor.moe.routing_replay={mode}", f"job.output_dir={tmp_path}",
             f"job.name={mode}")
        runs[mode] = tensorboard_scalars(tmp_path / mode)
    metric = lambda mode, name: next(v for k, v in runs[mode].items() if k.endswith(name))   # noqa: E731
    agreement = metric("r3", "moe/routing_agreement")
    assert sorted(agreement) == [1, 2] and agreement[1] >= 0.95, agreement
    diffs = {mode: metric(mode, "rollout/logprob_abs_diff_mean")[1] for mode in runs}
    assert all(d == d and d < 1.0 for d in diffs.values()), diffs
    assert diffs["r3"] <= diffs["off"], diffs


@pytest.mark.parametrize("preset", ["tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_vlm_logits_on_cuda_match_transformers_and_a_trainable_tower_trains(cuda_platform, tmp_path, preset):
    """The tiny VLMs on CUDA (packed row, `varlen` attention, Qwen3-VL's interleaved mRoPE and
    deepstack): fp32 logits within 1e-4 of transformers' (fp32 on the CPU); then, tower trainable,
    one fp32 backward (megatron's DDP buffers) reaches every tower tensor."""
    from mrl.engine.packing import _thd_params
    from mrl.models.megatron import complete_hf_config
    from mrl.models.roles import build_role_model
    from mrl.models.vlm import open_columns
    from mrl.models.vlm_gpt import set_vision_trainable
    from mrl.platform.config import ParallelConfig
    from mrl.weights import load_hf_checkpoint
    from tests.weights.test_vlm import save_checkpoint

    d = save_checkpoint(tmp_path, preset)
    hf = complete_hf_config(json.loads((d / "config.json").read_text()))
    model = build_role_model("actor", hf, ParallelConfig(), dtype="float32", device="cuda", attention="varlen")
    load_hf_checkpoint([model], d, hf)
    ref = torch.load(d / "reference.pt")
    keep = open_columns(hf)

    def forward(m):
        return m(ref["row"].cuda(), ref["position_ids"].cuda(), None,
                 packed_seq_params=_thd_params(ref["lengths"], "cuda"),
                 pixel_values=ref["pixel_values"].cuda(), image_grid_thw=ref["image_grid_thw"].cuda())

    with torch.no_grad():
        got = forward(model)[0, :, : hf["vocab_size"]].float().cpu()
    assert (got[:, keep] - ref["logits"][:, keep]).abs().max().item() <= 1e-4
    from mrl.optim.build import wrap_ddp

    set_vision_trainable([model], True)
    ddp = wrap_ddp([model], distributed_optimizer=False)   # main_grad buffers (TE's fused wgrad needs them)
    ddp[0].zero_grad_buffer()
    forward(ddp[0])[..., :200].float().square().mean().backward()
    assert all(p.main_grad.abs().sum() > 0 for p in model.vision.parameters())


def test_gemma3_vlm_logits_on_cuda_match_transformers(cuda_platform, tmp_path):
    """The tiny multimodal Gemma 3 on CUDA: `model.attention = "auto"` resolves to `sdpa` (its
    images' bidirectional blocks are an SDPA mask; `varlen` and `te` are refused), fp32 logits of
    the packed image row within 1e-4 of transformers' (fp32 on the CPU)."""
    from mrl.engine.packing import _thd_params
    from mrl.models.megatron import complete_hf_config
    from mrl.models.roles import build_role_model
    from mrl.models.vlm import open_columns
    from mrl.platform.config import ParallelConfig
    from mrl.weights import load_hf_checkpoint
    from tests.weights.vlm_archs import save_gemma3_checkpoint

    d = save_gemma3_checkpoint(tmp_path)
    hf = complete_hf_config(json.loads((d / "config.json").read_text()))
    model = build_role_model("actor", hf, ParallelConfig(), dtype="float32", device="cuda", attention="auto")
    assert model.mrl_attention == "sdpa"
    load_hf_checkpoint([model], d, hf)
    ref = torch.load(d / "reference.pt")
    keep = open_columns(hf)
    with torch.no_grad():
        got = model(ref["row"].cuda(), ref["position_ids"].cuda(), None,
                    packed_seq_params=_thd_params(ref["lengths"], "cuda"),
                    pixel_values=ref["pixel_values"].cuda())[0, :, : hf["vocab_size"]].float().cpu()
    assert (got[:, keep] - ref["logits"][:, keep]).abs().max().item() <= 1e-4


def test_a_vision_language_grpo_run_on_cuda_in_bf16(tmp_path):
    """`mrl train` of the VLM quickstart (tiny Qwen2.5-VL: mRoPE language model, HF vision tower on
    the first stage) on one GPU in bf16 with the HF engine on CUDA, images through the processor to
    both sides: three steps log a reward each, and step 1's train/rollout log-prob mismatch is
    finite and small (both sides bf16 on CUDA with different attention kernels; the CPU runs in
    tests/models hold the fp32 equality)."""
    pytest.importorskip("tensorboard")
    _mrl("train", "jobs/quickstart_vlm_cpu.toml", "platform.device=cuda", "platform.ranks_per_node=1",
         "parallel.tensor=1", "model.dtype=bfloat16", "tracking.backends=[\"console\",\"tensorboard\"]",
         "checkpoint.every_steps=0", "trainer.total_steps=3", f"job.output_dir={tmp_path}", "job.name=vlm")
    scalars = tensorboard_scalars(tmp_path / "vlm")
    metric = lambda name: next(v for k, v in scalars.items() if k.endswith(name))   # noqa: E731
    assert sorted(metric("reward/mean")) == [1, 2, 3], sorted(scalars)
    audit = metric("rollout/logprob_abs_diff_mean")[1]
    assert audit == audit and audit < 0.05, audit
