"""Fast tier of the platform layer: single process, no torchrun."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mrl.errors import CollectiveTimeout, UserError
from mrl.platform import dist as mdist
from mrl.platform import launch as mlaunch
from mrl.platform import device as mdevice
from mrl.platform import parallel as mparallel
from mrl.platform.config import ParallelConfig, PlatformConfig

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- device

def test_cuda_requested_without_gpu_is_a_user_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError) as e:
        mdevice.check_platform("cuda")
    assert str(e.value) == ("platform.device = 'cuda' but torch.cuda.is_available() is False; "
                            "set platform.device = 'cpu' for the CPU development platform")


def test_unknown_platform_and_missing_gpu_for_local_rank(monkeypatch):
    with pytest.raises(UserError, match="'tpu' is not one of"):
        mdevice.check_platform("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(UserError, match="local rank 3 has no GPU: this node shows 2 CUDA device"):
        mdevice.rank_device("cuda", 3)
    assert mdevice.rank_device("cuda", 1) == torch.device("cuda", 1)
    assert mdevice.rank_device("cpu", 5) == torch.device("cpu")


def test_cpu_threads_split_cores_between_ranks():
    assert mdevice.default_cpu_threads(2, cores=8) == 4
    assert mdevice.default_cpu_threads(16, cores=8) == 1
    before = torch.get_num_threads()
    try:
        assert mdevice.configure_cpu_threads(3, local_world_size=2) == 3
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------- launch detection

@pytest.mark.parametrize("nodelist,hosts", [
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("gpu5", ["gpu5"]),
    ("a[1-2],b[08-10]", ["a1", "a2", "b08", "b09", "b10"]),
    ("node[1-2],login", ["node1", "node2", "login"]),
    ("r[1-2]-n[01-02]", ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
    ("dgx-[098-100]", ["dgx-098", "dgx-099", "dgx-100"]),
])
def test_expand_slurm_nodelist(nodelist, hosts):
    assert mlaunch.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[1-", "node]1[", "node[3-1]", "node[a-b]", ""])
def test_malformed_nodelist_is_rejected(bad):
    with pytest.raises(ValueError):
        mlaunch.expand_nodelist(bad)


def test_detect_slurm_launch():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "123456",
           "SLURM_JOB_NODELIST": "gpu[07-08,11]", "SLURM_STEP_NODELIST": "gpu[08,11]",
           "SLURM_STEP_TASKS_PER_NODE": "8(x2)"}
    launch = mlaunch.detect_launch(env)
    assert launch == mlaunch.LaunchEnv(launcher="slurm", rank=5, world_size=16, local_rank=1, local_world_size=8,
                                     master_addr="gpu08", master_port=15000 + 123456 % 15000)
    launch = mlaunch.detect_launch({**env, "MASTER_PORT": "29999", "MASTER_ADDR": "head"})
    assert (launch.master_addr, launch.master_port) == ("head", 29999)


def test_torchrun_wins_over_slurm_and_single_is_the_fallback():
    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h",
           "MASTER_PORT": "1234", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_NODELIST": "x"}
    launch = mlaunch.detect_launch(env)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank, launch.local_world_size,
            launch.master_addr, launch.master_port) == ("torchrun", 1, 4, 1, 2, "h", 1234)
    assert mlaunch.detect_launch({}) == mlaunch.LaunchEnv("single", 0, 1, 0, 1)
    with pytest.raises(UserError, match="RANK='x' is not an integer"):
        mlaunch.detect_launch({"RANK": "x", "WORLD_SIZE": "2"})


def test_world_size_mismatch_message():
    with pytest.raises(UserError) as e:
        mlaunch.check_world_size(2, 8, "torchrun")
    msg = str(e.value)
    assert "expects world size 8 (platform.nodes x platform.ranks_per_node)" in msg
    assert "torchrun started 2 rank(s)" in msg
    mlaunch.check_world_size(8, 8, "slurm")


def test_backend_resolution():
    assert mlaunch.resolve_backend("auto", "cuda") == "nccl"
    assert mlaunch.resolve_backend("auto", "cpu") == "gloo"
    assert mlaunch.resolve_backend("gloo", "cuda") == "gloo"
    with pytest.raises(UserError, match="'nccl' needs platform.device = 'cuda'"):
        mlaunch.resolve_backend("nccl", "cpu")


def test_layout_checks():
    with pytest.raises(UserError, match="not divisible by parallel.tensor x parallel.pipeline"):
        mparallel.check_layout(ParallelConfig(tensor=3), 4, "cpu")
    with pytest.raises(UserError, match="sequence_parallel is not available on the cpu platform"):
        mparallel.check_layout(ParallelConfig(tensor=2, sequence_parallel=True), 2, "cpu")
    with pytest.raises(UserError, match="expert_tensor x parallel.expert"):
        mparallel.check_layout(ParallelConfig(expert=3), 4, "cuda")
    mparallel.check_layout(ParallelConfig(tensor=2, sequence_parallel=True), 2, "cuda")


# --------------------------------------------------------------------------- stages

def test_stage_turns_a_backend_timeout_into_collective_timeout():
    with pytest.raises(CollectiveTimeout) as e:
        with mdist.stage("weight sync", 0.2, watchdog=False):
            time.sleep(0.2)
            raise RuntimeError("[gloo/unbound_buffer.cc:78] Timed out waiting 200ms for recv operation")
    assert str(e.value).startswith("collective in stage 'weight sync' did not finish within 0.2 s")
    assert isinstance(e.value.__cause__, RuntimeError)


def test_stage_notes_other_errors_and_nests():
    with pytest.raises(RuntimeError) as e:
        with mdist.stage("rollout", 100, watchdog=False):
            with mdist.stage("reward", 100, watchdog=False):
                assert mdist.current_stage() == "reward"
                raise RuntimeError("Connection closed by peer")
    assert not isinstance(e.value, CollectiveTimeout)
    assert any("stage 'reward'" in n for n in e.value.__notes__)
    assert mdist.current_stage() is None


def test_watchdog_ends_a_process_stuck_in_a_stage():
    code = textwrap.dedent("""
        import time
        from mrl.platform.dist import stage
        with stage("weight sync", 0.5, grace_s=0.3):
            time.sleep(60)  # stands for a collective stuck in C++
    """)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == mdist.WATCHDOG_EXIT_CODE, proc.stderr
    assert "stage 'weight sync' has run past its 0.5 s collective timeout" in proc.stderr
    assert "collective in stage 'weight sync' did not finish within 0.5 s" in proc.stderr
    assert time.monotonic() - t0 < 30


# --------------------------------------------------------------------------- cpu compat

@pytest.fixture
def compat():
    from mrl.platform import cpu_compat

    cpu_compat.deactivate()
    yield cpu_compat
    cpu_compat.deactivate()


def test_compat_refuses_an_untested_megatron_version(compat, monkeypatch):
    monkeypatch.setattr(compat, "installed_megatron_version", lambda: "0.17.0")
    monkeypatch.delenv(compat.FORCE_ENV, raising=False)
    with pytest.raises(UserError) as e:
        compat.activate()
    msg = str(e.value)
    assert "megatron-core 0.16.1 but 0.17.0 is installed" in msg and "MRL_CPU_COMPAT_FORCE=1" in msg
    assert not compat.is_active() and not compat.active_patches()
    monkeypatch.setenv(compat.FORCE_ENV, "1")
    with pytest.warns(RuntimeWarning, match="0.17.0 is untested"):
        compat.activate()
    assert compat.is_active()


def test_compat_activate_deactivate_is_idempotent_and_reversible(compat):
    import importlib

    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    view_mods = [importlib.import_module(m) for m in compat.VIEW_MODULES]
    orig_clip = clip_grads.clip_grad_by_total_norm_fp32
    orig_splits = token_dispatcher.maybe_move_tensor_to_cpu
    had_te_gemm = hasattr(moe_utils, "te_general_gemm")

    compat.activate()
    first = compat.active_patches()
    compat.activate()
    assert compat.active_patches() == first and len(first) == len(compat.PATCHES)
    assert all(m.torch is not torch and m.torch.cuda.current_device() == torch.device("cpu") for m in view_mods)
    assert clip_grads.clip_grad_by_total_norm_fp32 is not orig_clip
    assert optimizer.clip_grad_by_total_norm_fp32 is clip_grads.clip_grad_by_total_norm_fp32
    assert moe_utils.te_general_gemm is None

    compat.deactivate()
    compat.deactivate()
    assert not compat.is_active()
    assert all(m.torch is torch for m in view_mods)
    assert clip_grads.clip_grad_by_total_norm_fp32 is orig_clip is optimizer.clip_grad_by_total_norm_fp32
    assert token_dispatcher.maybe_move_tensor_to_cpu is orig_splits
    assert hasattr(moe_utils, "te_general_gemm") == had_te_gemm


def test_torch_view_and_tensor_method_mode(compat):
    from mrl.platform import cpu_torch

    view = cpu_torch.VIEW
    assert view.zeros(2, device="cuda").device.type == "cpu"
    assert view.tensor([1.0], device=torch.device("cuda", 0)).device.type == "cpu"
    assert view.nn is torch.nn and view.float32 is torch.float32
    with view.cuda.stream(view.cuda.Stream()):
        view.cuda.current_stream().record_event().synchronize()
    t = torch.ones(2)
    with cpu_torch.CudaMethodsOnCpu():
        assert t.cuda() is t
        assert t.type() == "torch.cuda.FloatTensor"
        assert t.to("cuda").device.type == "cpu"
        assert torch.empty(1, device="cuda").device.type == "cpu"
    assert t.type() == "torch.FloatTensor"  # the mode is scoped


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only failure mode")
def test_single_process_cpu_platform_runs_megatron_and_needs_compat():
    """setup() as world 1 on cpu: a GPTModel forward/backward works with the compat layer and
    fails without it (so the layer is doing real work); teardown() restores everything."""
    from mrl import platform
    from mrl.platform import cpu_compat
    from mrl.models import tiny_model as tm

    spec = tm.TinyGPTSpec(num_layers=1, hidden_size=32, num_attention_heads=2, num_query_groups=1,
                          ffn_hidden_size=32, vocab_size=32, seq_length=8)
    with platform.setup(PlatformConfig(device="cpu", ranks_per_node=1, cpu_threads=1), ParallelConfig(),
                        seed=3) as ctx:
        assert (ctx.launcher, ctx.world_size, ctx.dp, ctx.layout.tp, ctx.backend) == ("single", 1, 1, 1, "gloo")
        assert platform.current() is ctx and cpu_compat.is_active()
        with pytest.raises(RuntimeError, match="already called"):
            platform.setup(PlatformConfig(device="cpu", ranks_per_node=1), ParallelConfig(), seed=3)
        model = tm.build_tiny_gpt(spec)
        ids = torch.randint(0, spec.vocab_size, (2, spec.seq_length))
        args = (ids, tm.position_ids(2, spec.seq_length), None)
        logits = model(*args)
        assert logits.shape == (2, spec.seq_length, spec.vocab_size)
        # Unpacked rows are causal sequences of their own (mrl's attention takes no dense mask).
        assert torch.equal(model(ids, args[1], None), logits)
        logits.sum().backward()
        assert all(p.grad is not None for p in model.parameters())
        # Megatron's RNG streams live on the CPU generator and are reproducible.
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        with get_cuda_rng_tracker().fork():
            a = torch.rand(3)
        platform.parallel.seed_model_parallel(3, "cpu")
        with get_cuda_rng_tracker().fork():
            b = torch.rand(3)
        assert torch.equal(a, b) and not torch.equal(a, torch.rand(3))
        # Megatron's device-side init path (use_cpu_initialization=False) allocates on "the current
        # CUDA device" and draws from the tensor-parallel RNG stream: on cpu, the CPU generator.
        dev_init = tm.build_tiny_gpt(spec, config=tm.tiny_gpt_config(spec, use_cpu_initialization=False))
        assert all(p.device.type == "cpu" for p in dev_init.parameters())
        assert dev_init(*args).shape == logits.shape
        cpu_compat.deactivate()
        try:
            # A new sequence length misses RoPE's cache: get_emb calls torch.cuda.current_device().
            short = (ids[:, :4], tm.position_ids(2, 4), None)
            with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
                model(*short)
        finally:
            cpu_compat.activate()
    assert not dist.is_initialized() and not cpu_compat.is_active()
    with pytest.raises(RuntimeError, match="has not been called"):
        platform.current()


def test_setup_refuses_a_world_size_mismatch_before_any_collective():
    from mrl import platform

    with pytest.raises(UserError, match="expects world size 8 .* but this is one plain process, not a torchrun or srun launch: start it with `mrl launch JOB`"):
        platform.setup(PlatformConfig(device="cpu", ranks_per_node=8), ParallelConfig(), seed=0, env={})
    assert not dist.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="exercises the cpu platform")
def test_single_process_bf16_ddp_and_megatron_optimizer_step():
    """bf16 params with megatron's DDP and mixed-precision optimizer (fp32 main params, type checks
    on `param.type()`, `found_inf` buffers): one clipped Adam step on the cpu platform."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from mrl import platform
    from mrl.models import tiny_model as tm

    spec = tm.TinyGPTSpec(num_layers=1, hidden_size=32, num_attention_heads=2, num_query_groups=1,
                          ffn_hidden_size=32, vocab_size=32, seq_length=8)
    with platform.setup(PlatformConfig(device="cpu", ranks_per_node=1, cpu_threads=1), ParallelConfig(), seed=3):
        cfg = tm.tiny_gpt_config(spec, params_dtype=torch.bfloat16, bf16=True)
        model = tm.build_tiny_gpt(spec, config=cfg)
        ddp = DistributedDataParallel(config=cfg, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                      module=model)
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, params_dtype=torch.bfloat16,
                                                     clip_grad=1e-3), [ddp])
        assert [type(o).__name__ for o in opt.chained_optimizers] == ["Float16OptimizerWithFloat16Params"]
        ids = torch.randint(0, spec.vocab_size, (2, spec.seq_length))
        before = [p.detach().clone() for p in model.parameters()]
        loss = ddp(ids, tm.position_ids(2, spec.seq_length), None, labels=ids)
        loss.float().mean().backward()
        ddp.finish_grad_sync()
        ok, grad_norm, _ = opt.step()
        assert ok and grad_norm > 1e-3  # clipping ran
        assert model.embedding.word_embeddings.weight.dtype == torch.bfloat16  # (torch norms stay fp32)
        assert max((a - p).abs().max().item() for a, p in zip(before, model.parameters())) > 0
