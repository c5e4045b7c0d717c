"""Where the validator gets a model's architecture: presets, local directories, the HF cache."""
import json

from mrl.models.facts import KNOWN_MODELS, find_hf_config, model_facts


def test_local_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="qwen2", num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
        hidden_size=48, vocab_size=100)))
    facts = model_facts(str(tmp_path))
    assert (facts.num_layers, facts.num_attention_heads, facts.num_query_groups) == (3, 6, 2)
    assert facts.source.endswith("config.json")


def test_hub_id_from_the_local_cache(tmp_path, monkeypatch):
    # the Hugging Face cache layout: models--org--name/snapshots/<rev>/config.json + refs/main
    repo = tmp_path / "models--acme--tiny-moe"
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    (snap / "config.json").write_text(json.dumps(dict(
        model_type="qwen3_moe", num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        hidden_size=64, vocab_size=128, num_experts=16, num_experts_per_tok=2)))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path))
    facts = model_facts("acme/tiny-moe")
    assert facts is not None and facts.num_experts == 16 and "snapshots" in facts.source


def test_known_table_and_unknown():
    assert model_facts("Qwen/Qwen3-30B-A3B").num_experts == KNOWN_MODELS["Qwen/Qwen3-30B-A3B"]["num_experts"]
    assert model_facts("nobody/no-such-model-here") is None
    assert find_hf_config("builtin:nope") is None


def test_new_architectures_facts(tmp_path):
    """A kimi_k2 directory reads as deepseek_v3 with its routed experts; GLM-4.5-Air validates offline."""
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="kimi_k2", num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64, hidden_size=7168,
        vocab_size=163840, n_routed_experts=384, num_experts_per_tok=8)))
    cfg, _ = find_hf_config(str(tmp_path))
    assert cfg["model_type"] == "deepseek_v3"
    facts = model_facts(str(tmp_path))
    assert (facts.num_layers, facts.num_experts, facts.experts_per_token) == (61, 384, 8)
    air = model_facts("zai-org/GLM-4.5-Air")
    assert (air.num_attention_heads, air.num_query_groups, air.num_experts) == (96, 8, 128)
    assert model_facts("builtin:tiny-glm4-moe").num_experts == 4 and model_facts("builtin:tiny-kimi-k2").num_experts == 4
