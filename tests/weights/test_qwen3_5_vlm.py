"""The multimodal Qwen3.5 (`qwen3_5`, `qwen3_5_moe`: Qwen3-VL's tower without deepstack + the Gated
DeltaNet hybrid text model, interleaved mRoPE on the gated-attention layers' partial-rotary dims)
against `transformers`' Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration:
logits of a packed row of image prompts (fp32 1e-5, bf16 close), the HF -> megatron -> HF round trip, the hf
engine's log-probs with images against the trainer's, the presets and refusals. `qwen3_5` at TP=2
/ PP=2: test_vlm's shared launch (`test_tp2_and_pp2_match_transformers`); `qwen3_5_moe` there: untested."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from tests.weights.vlm_archs import image_prompt_inputs, one_rank_platform, open_columns, packed_logits_gap
from tests.weights.vlm_archs import save_qwen3_5_checkpoint
from tests.weights.vlm_archs import megatron_from_dir as _megatron
from tests.weights.vlm_archs import packed_logits as _packed
from tests.weights.vlm_archs import trainer_audit

platform = pytest.fixture(scope="module")(one_rank_platform)

PRESETS = ("tiny-qwen3.5-vl", "tiny-qwen3.5-moe-vl")


@pytest.fixture(scope="module", params=PRESETS)
def checkpoint(request, tmp_path_factory):
    return save_qwen3_5_checkpoint(tmp_path_factory.mktemp(request.param), request.param)



def test_packed_logits_equal_transformers(platform, checkpoint):
    """Two image prompts (3 images) packed in one row: transformers' logits within 1e-5 (fp32), the
    placeholders banned; the images and the mRoPE ids matter (blank images, or plain ids, differ)."""
    hf, model = _megatron(checkpoint)
    ref = torch.load(checkpoint / "reference.pt")
    keep = open_columns(hf)
    diff = packed_logits_gap(model, hf, ref)
    print(f"{hf['model_type']} fp32 packed logits max diff {diff:.2e}")
    assert diff <= 1e-5
    plain = dict(ref, position_ids=torch.cat([torch.arange(n) for n in ref["lengths"]]).unsqueeze(0))
    assert (_packed(model, plain)[:, : hf["vocab_size"]][:, keep] - ref["logits"][:, keep]).abs().max().item() > 1e-4


def test_bf16_logits_close_to_transformers(platform, checkpoint):
    """bf16 on both sides (each prompt alone in transformers): each token's logits within bf16 rounding
    of the fp32 logits and of each other (the MoE model: but one token, a routing flip)."""
    from transformers import AutoModelForImageTextToText

    hf, model = _megatron(checkpoint, dtype="bfloat16")
    ref = torch.load(checkpoint / "reference.pt")
    keep = open_columns(hf)
    got = _packed(model, ref, torch.bfloat16)[:, : hf["vocab_size"]][:, keep].float()
    hf_bf16 = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    cut, want = int(ref["image_grid_thw"][0].prod()), []
    for i, (n, pix, grid) in enumerate(((ref["lengths"][0], ref["pixel_values"][:cut], ref["image_grid_thw"][:1]),
                                        (ref["lengths"][1], ref["pixel_values"][cut:], ref["image_grid_thw"][1:]))):
        ids = ref["ids"][i:i + 1, :n]
        with torch.no_grad():
            want.append(hf_bf16(input_ids=ids, pixel_values=pix.bfloat16(), image_grid_thw=grid,
                                mm_token_type_ids=(ids == hf["image_token_id"]).int()).logits[0].float())
    want = torch.cat(want)[:, keep]
    scale = ref["logits"].abs().max().item()
    # the MoE model: a token whose top-2 experts are a near tie may route to another expert in bf16
    # (measured: 1 of 35 tokens, 0.70 off against fp32; the others within 0.11)
    flips = 1 if hf["model_type"] == "qwen3_5_moe" else 0
    for other in (ref["logits"][:, keep], want):
        far = (got - other).abs().max(-1).values > 0.05 * scale
        assert int(far.sum()) <= flips, far.nonzero().flatten().tolist()


def test_export_is_bit_exact_and_loads_in_transformers(platform, checkpoint, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from mrl.weights import Exporter

    hf, model = _megatron(checkpoint)
    stream = dict(Exporter([model], hf).stream())
    assert any(n.startswith("model.visual.blocks.1.") for n in stream)
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in stream
    assert ("lm_head.weight" in stream) == (not hf["tie_word_embeddings"])
    saved = load_file(checkpoint / "model.safetensors")
    assert set(stream) == set(saved)
    # what mrl plan sizes the weight sync from: the same names and shapes
    from mrl.weights.sync_plan import hf_tensors

    assert {t.name: t.shape for t in hf_tensors(hf)} == {n: tuple(t.shape) for n, t in saved.items()}
    assert all(torch.equal(stream[n], t) for n, t in saved.items())
    save_file(stream, tmp_path / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(checkpoint / "config.json", tmp_path / "config.json")
    ref = torch.load(checkpoint / "reference.pt")
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32).eval()
    n = ref["lengths"][0]
    with torch.no_grad():
        got = reloaded(input_ids=ref["ids"][:1, :n], pixel_values=ref["pixel_values"][:16],
                       image_grid_thw=ref["image_grid_thw"][:1],
                       mm_token_type_ids=(ref["ids"][:1, :n] == hf["image_token_id"]).int()).logits[0]
    assert torch.equal(got, ref["logits"][:n])


def test_hf_engine_logprobs_with_images_equal_the_trainer(platform, checkpoint):
    """The hf engine samples from the two image prompts (mRoPE ids in its prefill and decode,
    placeholders never sampled); the trainer (a Batch whose prompt items carry their images, packed
    by the Engine) scores the same tokens within 1e-4 (the step-1 audit, fp32). The MoE model's
    responses carry the routes its routers took (what routing replay feeds the trainer)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from mrl.engine.engine import Engine
    from mrl.rollout.hf import HFEngine
    from mrl.models.vlm import mrope_position_ids
    from mrl.rollout.types import Sampling

    hf, model = _megatron(checkpoint)
    prompts, inputs = image_prompt_inputs(hf)
    eng = HFEngine.from_pretrained(str(checkpoint), seed=0)
    resp = eng.generate(prompts, Sampling(n=2, temperature=1.0, max_tokens=8, seed=5, ignore_eos=True), images=inputs)
    banned = {hf["image_token_id"], hf["video_token_id"], hf["vision_start_token_id"], hf["vision_end_token_id"]}
    assert not banned & {t for r in resp for t in r.token_ids}
    items = [SimpleNamespace(images=replace(x, prompt_positions=mrope_position_ids(
        hf, torch.tensor([p]), x.image_grid_thw)[:, 0])) for p, x in zip(prompts, inputs)]
    worst, out = trainer_audit(model, hf, prompts, resp, items)
    print(f"{hf['model_type']} AUDIT max |rollout - trainer| log-prob {worst:.3e}")
    assert worst <= 1e-4, worst
    assert torch.isfinite(out["entropy"]).all()
    assert eng.returns_routes == (hf["model_type"] == "qwen3_5_moe")
    if eng.returns_routes:   # each response's routes are the experts a whole-sequence forward with its images picks
        from mrl.rollout.hf_routes import RouteCapture

        for r in resp:
            seq = torch.tensor([prompts[r.prompt_index] + r.token_ids])
            x = inputs[r.prompt_index]
            with RouteCapture(eng.model) as cap, torch.no_grad():
                eng.model(input_ids=seq, pixel_values=x.pixel_values, image_grid_thw=x.image_grid_thw,
                          mm_token_type_ids=(seq == hf["image_token_id"]).int())
                want = cap.take(1, seq.shape[1])[0]
            assert r.routes.shape == (seq.shape[1], 2, hf["num_experts_per_tok"])
            assert torch.equal(r.routes, want)


def test_presets_facts_and_refusals(capsys):
    """The presets read as transformers completes them (sections 2/1/1 of the 4 rotary frequencies,
    interleaved); `mrl validate` takes the VLM quickstart with them and refuses vLLM in one line."""
    from mrl.cli import main
    from mrl.models.config import ModelConfig
    from mrl.models.facts import find_hf_config, model_facts
    from mrl.models.megatron import architecture_problems, hf_config, hf_inv_freq, rotary_fraction
    from mrl.models.vlm import deepstack_layers, mrope_interleaved, mrope_section, nested

    for preset, text_type in (("tiny-qwen3.5-vl", "qwen3_5_text"), ("tiny-qwen3.5-moe-vl", "qwen3_5_moe_text")):
        hf = hf_config(ModelConfig(path=f"builtin:{preset}"))
        assert (hf["model_type"], hf["head_dim"], hf["layer_types"]) == (
            text_type[:-5], 32, ["linear_attention", "full_attention"])
        assert mrope_section(hf) == [2, 1, 1] and mrope_interleaved(hf) and deepstack_layers(hf) == 0
        assert rotary_fraction(hf) == 0.25 and hf_inv_freq(hf).shape == (4,)
        assert nested(find_hf_config(f"builtin:{preset}")[0])["text_config"]["model_type"] == text_type
        assert architecture_problems(find_hf_config(f"builtin:{preset}")[0]) == []
        facts = model_facts(f"builtin:{preset}")
        assert (facts.num_layers, facts.num_attention_heads, facts.num_query_groups) == (2, 4, 2)
    job = ["validate", "jobs/quickstart_vlm_cpu.toml", "model.path=builtin:tiny-qwen3.5-vl"]
    assert main(job) == 0
    capsys.readouterr()
    assert main(job + ["rollout.engine=vllm"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "rollout.engine: 'vllm' does not run the multimodal qwen3_5 here" in err[0], err
