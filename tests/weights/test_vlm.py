"""Qwen2.5-VL and Qwen3-VL on megatron (mRoPE language model + Hugging Face vision tower; Qwen3-VL's
interleaved sections and deepstack features) against `transformers`: logits on image prompts
(packed and batched rows, fp32 and bf16), export round trip, the presets, and TP=2 / PP=2 of both
models in one 2-rank launch (slow)."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import save_file

from tests.dist_util import REPO, run_torchrun
from tests.weights.vlm_archs import assert_bf16_logits_close, image_prompts, make_vlm, one_rank_platform, open_columns
from tests.weights.vlm_archs import packed_logits_gap, save_gemma3_checkpoint, save_qwen3_5_checkpoint
from tests.weights.vlm_archs import megatron_from_dir as _megatron
from tests.weights.vlm_archs import packed_logits as _packed


platform = pytest.fixture(scope="module")(one_rank_platform)


PRESETS = ("tiny-qwen2.5-vl", "tiny-qwen3-vl")


def save_checkpoint(d, preset):
    """A saved tiny VLM of `preset` in `d` and `reference.pt`: one packed row of two image prompts
    (3 images), its mRoPE ids from `get_rope_index`, and `transformers`' logits for its real tokens."""
    from mrl.models.megatron import complete_hf_config
    from mrl.models.vlm import mrope_position_ids

    model = make_vlm(d, preset=preset)
    hf = complete_hf_config(json.loads((d / "config.json").read_text()))
    ids, mask, pixels, grids = image_prompts(hf)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grids,
                       mm_token_type_ids=(ids == hf["image_token_id"]).int()).logits
    lens = mask.sum(1).tolist()
    pos = mrope_position_ids(hf, ids, grids, mask)
    torch.save(dict(ids=ids, mask=mask, batched_logits=logits, lengths=lens, pixel_values=pixels,
                    image_grid_thw=grids, row=torch.cat([ids[i, :n] for i, n in enumerate(lens)]).unsqueeze(0),
                    position_ids=torch.cat([pos[:, i, :n] for i, n in enumerate(lens)], 1).unsqueeze(1),
                    logits=torch.cat([logits[i, :n] for i, n in enumerate(lens)])), d / "reference.pt")
    return d


@pytest.fixture(scope="module", params=PRESETS)
def vlm_checkpoint(request, tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp(request.param), request.param)



def test_rope_index_by_hand():
    """Text counts on; a 4x6-patch image (2x3 tokens after the 2x2 merge) after 3 tokens takes
    (3, 3+row, 3+col); text resumes at 3 + max(2, 3) = 6."""
    from mrl.models.facts import find_hf_config
    from mrl.models.vlm import mrope_position_ids

    hf = find_hf_config("builtin:tiny-qwen2.5-vl")[0]
    pad = hf["image_token_id"]
    ids = torch.tensor([[1, 2, hf["vision_start_token_id"]] + [pad] * 6 + [hf["vision_end_token_id"], 5]])
    pos = mrope_position_ids(hf, ids, torch.tensor([[1, 4, 6]]))[:, 0]
    assert pos[0].tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7]
    assert pos[1].tolist() == [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7]
    assert pos[2].tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7]


def test_interleaved_mrope_angles_by_hand():
    """Qwen3-VL's layout, 6 frequencies of 1: sections [2, 2, 2] put height at frequencies 1 and 4,
    width at 2 and 5; [4, 1, 1] height at 1, width at 2, temporal at the rest. Ids (t, h, w) =
    (1, 10, 100); the two halves repeat."""
    from mrl.models.vlm_gpt import interleaved_mrope_angles

    ids = torch.tensor([1, 10, 100]).view(3, 1, 1)
    got = interleaved_mrope_angles(ids, torch.ones(6), [2, 2, 2])
    assert got.shape == (1, 1, 1, 12)
    assert got.flatten().tolist() == [1, 10, 100, 1, 10, 100] * 2
    assert interleaved_mrope_angles(ids, torch.ones(6), [4, 1, 1]).flatten().tolist() == [1, 10, 100, 1, 1, 1] * 2


def test_packed_and_batched_logits_equal_transformers(platform, vlm_checkpoint):
    """Two image prompts packed in one `thd` row (mRoPE per token, restarting per prompt) and the
    same prompts as a right-padded batch: transformers' logits within 1e-5 (fp32)."""
    from mrl.models.vlm import mrope_position_ids

    hf, model = _megatron(vlm_checkpoint)
    ref = torch.load(vlm_checkpoint / "reference.pt")
    keep = open_columns(hf)
    # also: placeholders banned, the tower frozen and on this (first) stage, the images matter
    assert packed_logits_gap(model, hf, ref) <= 1e-5
    pos = mrope_position_ids(hf, ref["ids"], ref["image_grid_thw"], ref["mask"])
    with torch.no_grad():
        batched = model(ref["ids"], pos, None, pixel_values=ref["pixel_values"],
                        image_grid_thw=ref["image_grid_thw"])[..., : hf["vocab_size"]]
    for i, n in enumerate(ref["lengths"]):
        assert (batched[i, :n, keep] - ref["batched_logits"][i, :n, keep]).abs().max().item() <= 1e-5


def test_bf16_logits_close_to_transformers(platform, vlm_checkpoint):
    from transformers import AutoModelForImageTextToText as Qwen2_5_VLForConditionalGeneration

    hf, model = _megatron(vlm_checkpoint, dtype="bfloat16")
    ref = torch.load(vlm_checkpoint / "reference.pt")
    keep = open_columns(hf)
    got = _packed(model, ref, torch.bfloat16)[:, : hf["vocab_size"]][:, keep].float()
    hf_bf16 = Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_checkpoint, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        want = hf_bf16(input_ids=ref["ids"], attention_mask=ref["mask"], pixel_values=ref["pixel_values"].bfloat16(),
                       image_grid_thw=ref["image_grid_thw"],
                       mm_token_type_ids=(ref["ids"] == hf["image_token_id"]).int()).logits.float()
    want = torch.cat([want[i, :n] for i, n in enumerate(ref["lengths"])])[:, keep]
    assert_bf16_logits_close(got, want, ref, keep)


def test_export_loads_in_transformers_with_the_same_logits(platform, vlm_checkpoint, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText as Qwen2_5_VLForConditionalGeneration

    from mrl.weights import Exporter

    hf, model = _megatron(vlm_checkpoint)
    stream = dict(Exporter([model], hf).stream())
    tower = "model.visual." if hf["model_type"] == "qwen3_vl" else "visual."
    assert any(n.startswith(tower + "blocks.1.") for n in stream)
    # HF -> megatron -> HF is bit-exact: the same names (the deepstack mergers included), the same bits
    saved = load_file(vlm_checkpoint / "model.safetensors")
    assert set(stream) == set(saved)
    assert all(torch.equal(stream[n], t) for n, t in saved.items())
    save_file(stream, tmp_path / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(vlm_checkpoint / "config.json", tmp_path / "config.json")
    ref = torch.load(vlm_checkpoint / "reference.pt")
    reloaded = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        got = reloaded(input_ids=ref["ids"], attention_mask=ref["mask"], pixel_values=ref["pixel_values"],
                       image_grid_thw=ref["image_grid_thw"],
                       mm_token_type_ids=(ref["ids"] == hf["image_token_id"]).int()).logits
    assert torch.equal(got, ref["batched_logits"])


def test_preset_builds_and_refusals(platform):
    from mrl.errors import UserError
    from mrl.models.config import ModelConfig
    from mrl.models.facts import model_facts
    from mrl.models.megatron import hf_config, model_backend

    hf = hf_config(ModelConfig(path="builtin:tiny-qwen2.5-vl"))
    assert hf["model_type"] == "qwen2_5_vl" and hf["hidden_size"] == 128 and hf["vision_config"]["depth"] == 2
    facts = model_facts("builtin:tiny-qwen2.5-vl")
    assert (facts.num_layers, facts.num_attention_heads, facts.vocab_size) == (2, 4, 512)
    assert model_backend(hf, "auto", "cpu") == "sdpa"
    with pytest.raises(UserError, match="model.attention: 'reference' cannot run qwen2_5_vl's multimodal RoPE"):
        model_backend(hf, "reference", "cpu")

    from types import SimpleNamespace

    from mrl.models.vlm import training_problem

    def spec(teacher=None, **roll):
        r = {**dict(engine="hf", mode="spmd", partial_rollout_tokens=0, multi_turn=SimpleNamespace(enable=False)), **roll}
        return SimpleNamespace(rollout=SimpleNamespace(**r), parallel=SimpleNamespace(context=1),
                               distill=SimpleNamespace(model_path=teacher))

    assert training_problem(spec(), hf) is None
    for runs in (dict(engine="vllm"), dict(mode="server"), dict(engine="vllm", mode="server"),
                 dict(partial_rollout_tokens=4), dict(multi_turn=SimpleNamespace(enable=True))):
        assert training_problem(spec(**runs), hf) is None, runs   # every request carries its prompt's images
    assert training_problem(spec(engine="sglang"), hf) == ("model.path: qwen2_5_vl (vision-language) does not run with "
                                                           "rollout.engine = 'sglang' (images reach the hf and vllm "
                                                           "engines only) yet")
    assert "distillation teacher" in training_problem(spec(teacher="builtin:tiny-qwen2"), hf)
    assert training_problem(spec(engine="sglang"), {"model_type": "qwen2"}) is None

    hf3 = hf_config(ModelConfig(path="builtin:tiny-qwen3-vl"))
    assert hf3["model_type"] == "qwen3_vl" and hf3["num_hidden_layers"] == 4 and hf3["head_dim"] == 32
    assert hf3["vision_config"]["deepstack_visual_indexes"] == [0, 1]
    assert model_facts("builtin:tiny-qwen3-vl").num_layers == 4


def test_deepstack_layers_off_the_first_stage_are_refused(platform):
    """Qwen3-VL's deepstack features enter on the first stage: a first stage without decoder
    layers 0-1 (here: 1 layer of the 4) is one line."""
    from mrl.errors import UserError
    from mrl.models.config import ModelConfig
    from mrl.models.megatron import build_gpt, hf_config, transformer_config
    from mrl.platform.config import ParallelConfig

    hf = dict(hf_config(ModelConfig(path="builtin:tiny-qwen3-vl")), num_hidden_layers=1)
    config = transformer_config(hf, dtype="float32", parallel=ParallelConfig(), device="cpu")
    with pytest.raises(UserError, match=r"holds decoder layers \[0\], but the vision tower's deepstack features "
                                        r"enter layers 0-1"):
        build_gpt(hf, config)


@pytest.mark.slow
def test_tp2_and_pp2_match_transformers(tmp_path):
    """The five models (Qwen2.5-VL, Qwen3-VL, the multimodal Gemma 3, Qwen3.5 and Qwen3.5-MoE), TP=2 then PP=2, in one launch:
    bit-exact round trip, logits within 1e-5 (Gemma 3: its images attending both ways); the trainable tower's gradients (TP-averaged at TP=2, through the pipeline at PP=2)."""
    dirs = [save_checkpoint(tmp_path / p, p) for p in PRESETS] + [save_gemma3_checkpoint(tmp_path / "tiny-gemma3-vl"),
                                                                  save_qwen3_5_checkpoint(tmp_path / "tiny-qwen3.5-vl"),
                                                                  save_qwen3_5_checkpoint(tmp_path / "tiny-qwen3.5-moe-vl",
                                                                                          "tiny-qwen3.5-moe-vl")]
    proc = run_torchrun(REPO / "tests/weights/scripts/vlm_layouts.py", *[a for d in dirs for a in ("--dir", str(d))],
                        timeout=600)
    found = re.findall(r"^VLM (\w+) (tp\d pp\d) roundtrip ok \d+ tensors \((\d+) tower\) logits (\S+)",
                       proc.stdout, re.M)
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("VLM ")))
    assert [f[:2] for f in found] == [("qwen2_5_vl", "tp2 pp1"), ("qwen2_5_vl", "tp1 pp2"),
                                      ("qwen3_vl", "tp2 pp1"), ("qwen3_vl", "tp1 pp2"),
                                      ("gemma3", "tp2 pp1"), ("gemma3", "tp1 pp2"),
                                      ("qwen3_5", "tp2 pp1"), ("qwen3_5", "tp1 pp2"),
                                      ("qwen3_5_moe", "tp2 pp1"), ("qwen3_5_moe", "tp1 pp2")], proc.stdout
    assert all(int(t) > 0 and float(d) <= 1e-5 for _, _, t, d in found), proc.stdout
    # at TP=2 the trainable tower's gradients are equal over the TP group and averaged by megatron
    assert len(re.findall(r"^VLM \w+ tp2 pp1 .* tower grads \d+ equal over tp, averaged$", proc.stdout, re.M)) == 5
    # at PP=2 it trains through the pipeline schedule (the tower and deepstack on the first stage)
    assert len(re.findall(r"^VLM \w+ tp1 pp2 .* tower grads [1-9]\d* through the pipeline$", proc.stdout, re.M)) == 5


def test_validate_refuses_a_vlm_job_train_would_refuse(capsys):
    from mrl.cli import main

    assert main(["validate", "jobs/quickstart_vlm_cpu.toml"]) == 0
    capsys.readouterr()
    assert main(["validate", "jobs/quickstart_vlm_cpu.toml", "rollout.engine=sglang"]) == 2
    assert "qwen2_5_vl (vision-language) does not run with rollout.engine = 'sglang'" in capsys.readouterr().err
