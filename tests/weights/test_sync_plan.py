"""`mrl plan`: the weight-sync table for every shipped recipe, from the model config alone."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from mrl.cli import main
from mrl.config.loader import load
from mrl.models.facts import BUILTIN_PRESETS, KNOWN_MODELS
from mrl.weights.sync_plan import Links, delta_bytes, hf_tensors, plan_sync

JOBS = Path(__file__).resolve().parents[2] / "jobs"
# every GPU recipe, and the CPU ones on builtin presets (smollm2_chainsum_cpu reads a model that
# tools/models/smollm2.py builds locally)
RECIPES = sorted(p.name for p in JOBS.glob("*.toml") if "[sft]" not in p.read_text()
                 and ('device = "cpu"' not in p.read_text() or 'path = "builtin:' in p.read_text()))


@pytest.mark.parametrize("job", RECIPES)
def test_plan_prints_the_table_for_every_shipped_recipe(job, capsys, monkeypatch):
    import torch.nn

    def no_weights(*a, **k):
        raise AssertionError("mrl plan loaded weights")

    monkeypatch.setattr("safetensors.torch.load_file", no_weights)
    monkeypatch.setattr(torch.nn.Module, "load_state_dict", no_weights)
    assert main(["plan", str(JOBS / job)]) == 0
    out = capsys.readouterr().out
    for row in ("bytes per full sync", "bytes per delta sync", "buckets of", "trainer peak extra", "engine peak extra",
                "est. sync time, full", "est. sync time, delta"):
        assert row in out, (job, row)


@pytest.mark.parametrize("preset", sorted(BUILTIN_PRESETS))
def test_tensor_list_matches_a_transformers_model_of_the_config(preset):
    import transformers

    from mrl.models.facts import canonical_config
    from mrl.models.vlm import flatten, hf_config_object, is_vlm

    cfg = dict(BUILTIN_PRESETS[preset])
    if is_vlm(cfg):   # an image-text model: the language model under its own prefix, the tower as `visual.*`
        model = transformers.AutoModelForImageTextToText.from_config(hf_config_object(flatten(cfg)))
        kept = {n: tuple(t.shape) for n, t in model.state_dict().items()
                if not (cfg.get("tie_word_embeddings") and n == "lm_head.weight")}
        got = hf_tensors(cfg)
        # (the multimodal Qwen3.5-MoE: fused experts in memory, one tensor per expert projection in the list)
        assert sorted(s for n, s in kept.items() if ".mlp.experts." not in n) == sorted(
            t.shape for t in got if ".mlp.experts." not in t.name)
        assert sum(math.prod(s) for n, s in kept.items() if ".mlp.experts." in n) == sum(
            t.numel for t in got if ".mlp.experts." in t.name)
        tower = {n for n in model.state_dict() if n.startswith("model.visual.")}
        # Qwen2.5-VL checkpoints keep the tower as `visual.*`, Qwen3-VL's as `model.visual.*`
        named = {t.name for t in got if t.name.startswith(("visual.", "model.visual."))}
        assert {n if n.startswith("model.") else "model." + n for n in named} == tower
        if cfg["model_type"] in ("qwen3_vl", "qwen3_5"):   # and the language model as `model.language_model.*`
            text = {n for n in model.state_dict() if not n.startswith("model.visual.")
                    and not (cfg.get("tie_word_embeddings") and n == "lm_head.weight")}
            assert {t.name for t in got if not t.name.startswith("model.visual.")} == text
        if cfg["model_type"] == "gemma3":   # every name as its checkpoints keep it (the hf engine's renames)
            from mrl.rollout.hf_experts import checkpoint_name

            assert {t.name for t in got} == {checkpoint_name(n, "gemma3") for n in model.state_dict()} - {"lm_head.weight"}
        return
    hf_cfg = transformers.AutoConfig.for_model(**canonical_config(cfg))   # tiny-kimi-k2 as deepseek_v3
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    want = {n: tuple(t.shape) for n, t in model.state_dict().items()
            if not (cfg.get("tie_word_embeddings") and n == "lm_head.weight")}
    got = {t.name: t.shape for t in hf_tensors(cfg)}
    # transformers 5 holds a layer's experts fused in memory; checkpoints (and the exporter) name
    # each expert's projections: compare those by element count, everything else by name and shape
    fused = {n for n in want if ".mlp.experts." in n}
    assert sum(math.prod(want[n]) for n in fused) == sum(math.prod(s) for n, s in got.items() if ".mlp.experts." in n)
    assert {n: s for n, s in got.items() if ".mlp.experts." not in n} == {n: s for n, s in want.items() if n not in fused}


def test_known_models_have_their_published_parameter_counts():
    # Qwen2.5-32B: 32.76 B parameters; Qwen3-30B-A3B: 30.53 B (their model cards)
    assert sum(t.numel for t in hf_tensors(KNOWN_MODELS["Qwen/Qwen2.5-32B"])) / 1e9 == pytest.approx(32.76, abs=0.01)
    assert sum(t.numel for t in hf_tensors(KNOWN_MODELS["Qwen/Qwen3-30B-A3B"])) / 1e9 == pytest.approx(30.53, abs=0.01)
    # gpt-oss-20b: 20.91 B in all, 3.6 B active with the unembedding (its model card); Gemma 3 1B: 1.0 B
    assert sum(t.numel for t in hf_tensors(KNOWN_MODELS["openai/gpt-oss-20b"])) / 1e9 == pytest.approx(20.91, abs=0.01)
    assert sum(t.numel for t in hf_tensors(KNOWN_MODELS["google/gemma-3-1b-it"])) / 1e9 == pytest.approx(1.00, abs=0.01)
    # the multimodal Gemma 3 4B: text model, SigLIP tower and projector (its card: 4.3 B)
    assert sum(t.numel for t in hf_tensors(KNOWN_MODELS["google/gemma-3-4b-it"])) / 1e9 == pytest.approx(4.30, abs=0.01)
    # GLM-4.5-Air: "106B total parameters" (its model card), without its MTP layer (not synced)
    assert sum(t.numel for t in hf_tensors(KNOWN_MODELS["zai-org/GLM-4.5-Air"])) / 1e9 == pytest.approx(106, abs=1)


def test_delta_bytes_takes_the_smaller_of_sparse_and_whole():
    assert delta_bytes(1000, 2, 0.01) == 10 * 6          # 10 changed x (int32 index + bf16 value)
    assert delta_bytes(1000, 2, 0.5) == 2000             # sparse 3000 > whole 2000
    assert delta_bytes(1000, 2, 0.0) == 0


def test_groups_and_time_follow_the_layout_and_links():
    spec, _ = load(str(JOBS / "grpo_qwen3_30b_a3b.toml"), [])
    plan = plan_sync(spec, changed_fraction=0.02)
    names = {g.what: g for g, _ in plan.groups}
    assert names["TP all-gather"].link == "NVLink" and names["TP all-gather"].ranks == 2
    assert names["EP broadcast"].link == "NVLink" and names["EP broadcast"].ranks == 8
    assert names["PP broadcast"].link == "InfiniBand"   # stages 8 ranks apart on 8-GPU nodes
    slow = plan_sync(spec, links=Links(ib_gbps=25.0), changed_fraction=0.02)
    # the PP broadcast of every byte over InfiniBand takes twice as long at half the bandwidth
    assert slow.seconds_full - plan.seconds_full == pytest.approx(plan.full_bytes / 25e9 - plan.full_bytes / 50e9)
    assert plan.delta_bytes < plan.full_bytes


def test_separate_placement_crosses_the_bridge_and_delta_shrinks_it():
    spec, _ = load(str(JOBS / "quickstart_async_cpu.toml"), [])
    plan = plan_sync(spec, changed_fraction=0.01)
    bridge = [g for g, _ in plan.groups if g.what.startswith("bridge")]
    assert bridge, plan.groups
    assert plan.seconds_delta < plan.seconds_full


def test_plan_of_an_unknown_model_is_one_line(capsys, tmp_path):
    assert main(["plan", str(JOBS / "quickstart_cpu.toml"), "model.path=/nonexistent/model"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.path" in err[0]


def test_fp8_rollout_sends_linear_weights_as_one_byte_plus_block_scales():
    spec, _ = load(str(JOBS / "quickstart_fp8_cpu.toml"), [])
    plan = plan_sync(spec)
    # tiny-qwen2, tied: per layer q 128x128, k/v 64x128, o 128x128, gate/up 256x128, down 128x256 =
    # 147,456 fp8 bytes + 10 blocks x 4; embeddings 65,536, q/k/v biases 2 x 256 and 5 norms x 128 in bf16
    # (the quickstart_fp8 run measured weight_sync/bytes = 428,368 and 723,200 without fp8)
    assert plan.full_bytes == 2 * (147456 + 40) + 2 * (65536 + 2 * 256 + 5 * 128) == 428368
    bf16, _ = load(str(JOBS / "quickstart_fp8_cpu.toml"), ["rollout.quantization=none"])
    assert plan_sync(bf16).full_bytes == 2 * (2 * 147456 + 65536 + 2 * 256 + 5 * 128) == 723200
    assert "fp8" in plan.dtype and any("59.2% of the bfloat16 bytes" in n for n in plan.notes)
