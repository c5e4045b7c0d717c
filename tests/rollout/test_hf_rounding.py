"""The HF engine's norms and biases on CPU in bf16 round as the trainer's (mrl/rollout/hf_rounding.py):
with trained-looking weights (norms away from 1, biases away from 0) synced from a megatron actor,
the engine's sampled log-probs equal the trainer's packed forward's, as on the first step."""
from __future__ import annotations

import json

import pytest
import torch

from mrl.rollout.audit import logprob_audit, teacher_forced_logprobs
from mrl.rollout.types import Sampling
from tests.weights.archs import make_hf_model

PROMPTS = [[5, 17, 33, 2, 90, 41], [7, 7, 120, 64], [200, 3, 11, 9, 150, 77, 18, 4, 61]]


@pytest.fixture(scope="module")
def platform():
    from mrl import platform as plat
    from mrl.platform.config import ParallelConfig, PlatformConfig

    ctx = plat.setup(PlatformConfig(device="cpu", ranks_per_node=1, cpu_threads=1), ParallelConfig(), seed=11)
    yield ctx
    plat.teardown()


def _actor(tmp_path, arch: str):
    """A bf16 megatron actor loaded from a tiny random checkpoint whose norms and biases are perturbed."""
    from mrl.models.megatron import complete_hf_config
    from mrl.models.roles import build_role_model
    from mrl.platform.config import ParallelConfig
    from mrl.weights import load_hf_checkpoint

    make_hf_model(arch, tmp_path)
    hf = complete_hf_config(json.loads((tmp_path / "config.json").read_text()))
    model = build_role_model("actor", hf, ParallelConfig(), dtype="bfloat16", device="cpu")
    load_hf_checkpoint([model], tmp_path, hf, role="actor")
    return hf, model.eval()


def _packed_logits(model, vocab: int):
    """The trainer's forward as `forward_only` runs it: every row unpadded, packed into one `thd` row."""
    from mrl.engine.packing import _thd_params

    def run(ids, attn, pos):
        lengths = attn.sum(1).tolist()
        row = torch.cat([ids[b, :n] for b, n in enumerate(lengths)]).unsqueeze(0)
        positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        with torch.no_grad():
            out = model(row, positions, None, packed_seq_params=_thd_params(lengths, "cpu"))[0, :, :vocab]
        logits = torch.zeros(*ids.shape, vocab, dtype=out.dtype)
        for b, (start, n) in enumerate(zip([0, *torch.tensor(lengths).cumsum(0).tolist()], lengths)):
            logits[b, :n] = out[start:start + n]
        return logits

    return run


def _audit(engine, model, hf) -> dict[str, float]:
    sampling = Sampling(n=4, temperature=1.0, max_tokens=12, ignore_eos=True, seed=3)
    responses = engine.generate(PROMPTS, sampling)
    trainer, rollout, mask = teacher_forced_logprobs(_packed_logits(model, hf["vocab_size"]), PROMPTS, responses,
                                                     sampling)
    return logprob_audit(rollout, trainer, mask)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_bf16_engine_logprobs_equal_the_trainers_with_trained_norms_and_biases(platform, tmp_path, arch):
    """qwen2: QKV biases and norms; qwen3: QK-norms too. The engine gets the actor's bf16 export.
    Measured: audit mean 0 (qwen2, qwen3) against 4.7e-3 / 6.0e-3 with transformers' own modules."""
    from mrl.rollout.hf import HFEngine
    from mrl.rollout.hf_rounding import LLAMA_STYLE_NORMS
    from mrl.weights import Exporter

    hf, model = _actor(tmp_path, arch)
    engine = HFEngine.from_config(hf, dtype="bfloat16")
    engine.update_weights(Exporter([model], hf).stream())
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    aligned = _audit(engine, model, hf)
    # the same engine with transformers' own norms and biased linears: the mismatch the sync left
    for module in engine.model.modules():
        if "forward" in vars(module):
            del module.forward
            assert type(module).__name__ in LLAMA_STYLE_NORMS or isinstance(module, torch.nn.Linear)
    plain = _audit(engine, model, hf)
    assert aligned["rollout/audit_tokens"] == plain["rollout/audit_tokens"] == len(PROMPTS) * 4 * 12
    assert aligned["rollout/logprob_abs_diff_mean"] <= 1e-5, (aligned, plain)
    assert plain["rollout/logprob_abs_diff_mean"] > 10 * max(aligned["rollout/logprob_abs_diff_mean"], 1e-6), \
        (aligned, plain)


def test_fp32_and_vision_modules_are_left_alone():
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from mrl.models.facts import find_hf_config
    from mrl.models.vlm import hf_config_object
    from mrl.rollout.hf_rounding import trainer_rounding_on_cpu

    cfg = AutoConfig.for_model("qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1)
    assert trainer_rounding_on_cpu(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)) == 0
    # bf16: 3 norms (input, post-attention, final) and the q/k/v projections (biased); o_proj and the MLP have none
    assert trainer_rounding_on_cpu(AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)) == 6
    # under a TP=2 trainer also o_proj and down_proj: two half-width products, each rounded, added
    tp2 = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    assert trainer_rounding_on_cpu(tp2, tensor_parallel=2) == 8
    down = tp2.model.layers[0].mlp.down_proj
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    w = down.weight.detach()
    halves = torch.nn.functional.linear(x[:, :32], w[:, :32]) + torch.nn.functional.linear(x[:, 32:], w[:, 32:])
    with torch.no_grad():
        assert torch.equal(down(x), halves) and not torch.equal(halves, torch.nn.functional.linear(x, w))
    vlm = AutoModelForImageTextToText.from_config(hf_config_object(find_hf_config("builtin:tiny-qwen2.5-vl")[0]),
                                                  dtype=torch.bfloat16)
    trainer_rounding_on_cpu(vlm)
    changed = {n for n, m in vlm.named_modules() if "forward" in vars(m)}
    assert changed and not any(".visual." in f".{n}." for n in changed), sorted(changed)[:5]
    assert any("language_model" in n and n.endswith("norm") for n in changed), sorted(changed)
