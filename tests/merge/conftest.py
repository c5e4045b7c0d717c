"""Fixtures: tiny HF sources and the Megatron checkpoints saved from them at TP2 / EP2 (slow)."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.dist_util import run_torchrun
from tests.weights.archs import make_hf_model

SCRIPT = "tests/merge/scripts/save_checkpoints.py"


def _with_tokenizer(d):
    from mrl.models.tokenizer import byte_tokenizer

    byte_tokenizer().save_pretrained(str(d))
    return d


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """name -> (checkpoint root, HF source dir or preset, expected HF tensors), saved by one torchrun."""
    base = tmp_path_factory.mktemp("merge_src")
    q2 = base / "qwen2"
    make_hf_model("qwen2", q2)
    _with_tokenizer(q2)
    critic = base / "qwen2_critic"
    shutil.copytree(q2, critic)
    weights = load_file(str(critic / "model.safetensors"))
    weights["score.weight"] = torch.randn(1, 64, generator=torch.Generator().manual_seed(9))
    save_file(weights, str(critic / "model.safetensors"), metadata={"format": "pt"})
    moe = base / "qwen3_moe"
    make_hf_model("qwen3_moe", moe)
    q2moe, dsv3 = base / "qwen2_moe", base / "deepseek_v3"
    make_hf_model("qwen2_moe", q2moe)
    make_hf_model("deepseek_v3", dsv3)
    kimi = base / "kimi_k2"
    make_hf_model("kimi_k2", kimi)   # config.json says kimi_k2
    glm = base / "glm4_moe"
    make_hf_model("glm4_moe", glm)
    oss, gemma = base / "gpt_oss", base / "gemma3_text"
    make_hf_model("gpt_oss", oss)
    make_hf_model("gemma3_text", gemma)
    nxt = base / "qwen3_next"
    make_hf_model("qwen3_next", nxt)
    cases = {"q2_tp2": (q2, "actor", "tp2", "float32"),
             "q2_critic_tp2": (critic, "critic", "tp2", "float32"),
             "moe_ep2": (moe, "actor", "ep2", "float32"),
             "q2moe_ep2": (q2moe, "actor", "ep2", "float32"),
             "dsv3_tp2": (dsv3, "actor", "tp2", "float32"),
             "kimi_ep2": (kimi, "actor", "ep2", "float32"),
             "glm_tp2": (glm, "actor", "tp2", "float32"),
             "oss_ep2": (oss, "actor", "ep2", "float32"),
             "gemma_tp2": (gemma, "actor", "tp2", "float32"),
             "next_tp2": (nxt, "actor", "tp2", "float32"),
             "preset_bf16_tp2": ("builtin:tiny-qwen2", "actor", "tp2", "bfloat16"),
             "vl_preset_tp2": ("builtin:tiny-qwen2.5-vl", "actor", "tp2", "float32"),
             "vl3_preset_tp2": ("builtin:tiny-qwen3-vl", "actor", "tp2", "float32"),
             "gemma3vl_preset_tp2": ("builtin:tiny-gemma3-vl", "actor", "tp2", "float32")}
    out = base / "ckpts"
    out.mkdir()
    run_torchrun(SCRIPT, "--out", str(out), *[f"{n}:{s}:{r}:{l}:{d}" for n, (s, r, l, d) in cases.items()],
                 timeout=600)
    return {n: (out / n, s, load_file(str(out / f"{n}.expected.safetensors"))) for n, (s, *_) in cases.items()}
