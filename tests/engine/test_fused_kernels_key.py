"""`model.use_fused_kernels` acts: the log-prob kernels' backend and megatron's fused SwiGLU."""
from __future__ import annotations

import torch

from mrl.platform.config import ParallelConfig


def test_use_fused_kernels_false_selects_the_torch_twins_over_any_default(monkeypatch):
    from mrl_kernels import _dispatch

    t = torch.zeros(2, 4)
    monkeypatch.setenv("MRL_KERNELS_BACKEND", "triton")
    assert _dispatch.select_backend(t) == "triton"
    assert _dispatch.select_backend(t, "torch") == "torch"


def test_the_job_key_reaches_the_actor_objective_and_eval_outputs(monkeypatch):
    import mrl_kernels
    from mrl.config.loader import load
    from mrl.train import step

    seen = []
    real = mrl_kernels.logprob_entropy

    def spy(*args, backend=None, **kw):
        seen.append(backend)
        return real(*args, backend=backend, **kw)

    monkeypatch.setattr(mrl_kernels, "logprob_entropy", spy)
    from mrl.engine import objectives

    monkeypatch.setattr(objectives, "_tp_group", lambda: None)  # one rank, no megatron state
    for value, want in (("true", "auto"), ("false", "torch")):
        spec, _ = load("jobs/quickstart_cpu.toml", [f"model.use_fused_kernels={value}"])
        c = type("C", (), {"spec": spec, "hf": {"vocab_size": 8}})()
        assert step.kernel_backend(c) == want
        assert step.policy_objective(c).kernels == want
        from mrl.engine.objectives import response_logprobs

        mb = type("MB", (), {"take": lambda self, x: x[0], "gather": lambda self, x: x, "response_labels": torch.tensor([1, 2])})()
        response_logprobs(torch.randn(1, 2, 8), mb, kernels=step.kernel_backend(c))
        assert seen[-1] == want


def test_use_fused_kernels_turns_on_megatrons_fused_swiglu_on_cuda_only():
    from mrl.models.megatron import transformer_config

    hf = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2)
    cfg = lambda device, fused: transformer_config(hf, dtype="float32", parallel=ParallelConfig(), device=device,
                                                  attention="sdpa" if device == "cpu" else "varlen", fused=fused)
    assert cfg("cuda", True).bias_activation_fusion and not cfg("cuda", False).bias_activation_fusion
    assert not cfg("cpu", True).bias_activation_fusion
