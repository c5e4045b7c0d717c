"""The multimodal Gemma 3 (`gemma3`: SigLIP tower + projector + Gemma 3's text model on megatron)
against `transformers`' Gemma3ForConditionalGeneration: the image blocks and their mask by hand,
logits of a packed row of image prompts (fp32 1e-5, bf16 close), the bidirectional image
attention, the export round trip, the preset and its refusals. TP=2 / PP=2 run in test_vlm's
shared launch (`test_tp2_and_pp2_match_transformers`)."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from tests.weights.vlm_archs import megatron_from_dir as _megatron
from tests.weights.vlm_archs import assert_bf16_logits_close, one_rank_platform, open_columns, packed_logits_gap
from tests.weights.vlm_archs import save_gemma3_checkpoint
from tests.weights.vlm_archs import packed_logits as _packed
from tests.weights.vlm_archs import trainer_audit


platform = pytest.fixture(scope="module")(one_rank_platform)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_gemma3_checkpoint(tmp_path_factory.mktemp("gemma3"))



def test_image_blocks_and_mask_by_hand():
    """Runs of the image token are blocks (numbered over the tensor; a run does not continue into
    the next batch row); a block sees itself both ways, text stays causal, and a window of 1
    (megatron's: the token and one before) still cuts, also inside a block."""
    from mrl.models.gemma3_vlm import block_mask, image_blocks

    ids = torch.tensor([[1, 9, 9, 2, 9, 9, 9, 3], [9, 9, 4, 5, 6, 7, 8, 9]])
    assert image_blocks(ids, 9).tolist() == [[-1, 0, 0, -1, 1, 1, 1, -1], [2, 2, -1, -1, -1, -1, -1, 3]]
    blocks = torch.tensor([-1, 0, 0, -1, 1, 1, 1])
    m = block_mask(blocks, None).int().tolist()
    assert m[0] == [1, 0, 0, 0, 0, 0, 0]
    assert m[1] == [1, 1, 1, 0, 0, 0, 0]       # sees the later token of its image
    assert m[3] == [1, 1, 1, 1, 0, 0, 0]       # text: causal
    assert m[4] == [1, 1, 1, 1, 1, 1, 1]       # the first token of the second image sees the whole image
    w = block_mask(blocks, 1).int().tolist()
    assert w[4] == [0, 0, 0, 1, 1, 1, 1]       # window: itself and one before; its image's later tokens
    assert w[6] == [0, 0, 0, 0, 0, 1, 1]


def test_packed_logits_equal_transformers(platform, checkpoint):
    """Two image prompts (3 images) packed in one row: transformers' logits within 1e-5 (fp32),
    the placeholders banned; the images matter, and so does their bidirectional attention
    (transformers without `token_type_ids`, all causal, differs)."""
    hf, model = _megatron(checkpoint)
    ref = torch.load(checkpoint / "reference.pt")
    keep = open_columns(hf)
    diff = packed_logits_gap(model, hf, ref)
    print(f"gemma3 fp32 packed logits max diff {diff:.2e}")
    assert diff <= 1e-5
    assert (ref["causal_logits"][:, keep] - ref["logits"][:, keep]).abs().max().item() > 1e-3


def test_bf16_logits_close_to_transformers(platform, checkpoint):
    from transformers import AutoModelForImageTextToText

    hf, model = _megatron(checkpoint, dtype="bfloat16")
    ref = torch.load(checkpoint / "reference.pt")
    keep = open_columns(hf)
    got = _packed(model, ref, torch.bfloat16)[:, : hf["vocab_size"]][:, keep].float()
    hf_bf16 = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        want = hf_bf16(input_ids=ref["ids"], attention_mask=ref["mask"], pixel_values=ref["pixel_values"].bfloat16(),
                       token_type_ids=(ref["ids"] == hf["image_token_id"]).long()).logits.float()
    want = torch.cat([want[i, :n] for i, n in enumerate(ref["lengths"])])[:, keep]
    assert_bf16_logits_close(got, want, ref, keep)


def test_export_is_bit_exact_and_loads_in_transformers(platform, checkpoint, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from mrl.weights import Exporter

    hf, model = _megatron(checkpoint)
    stream = dict(Exporter([model], hf).stream())
    # the names transformers 5 writes: language_model.model.*, vision_tower.*, multi_modal_projector.*
    assert any(n.startswith("vision_tower.encoder.layers.1.") for n in stream)
    assert "multi_modal_projector.mm_input_projection_weight" in stream
    assert "language_model.model.layers.1.post_feedforward_layernorm.weight" in stream
    saved = load_file(checkpoint / "model.safetensors")
    assert set(stream) == set(saved)
    assert all(torch.equal(stream[n], t) for n, t in saved.items())
    save_file(stream, tmp_path / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(checkpoint / "config.json", tmp_path / "config.json")
    ref = torch.load(checkpoint / "reference.pt")
    reloaded = AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        got = reloaded(input_ids=ref["ids"], attention_mask=ref["mask"], pixel_values=ref["pixel_values"],
                       token_type_ids=(ref["ids"] == hf["image_token_id"]).long()).logits
    assert torch.equal(got, ref["batched_logits"])


def test_hub_layout_of_transformers_4_imports_the_same_weights(platform, checkpoint, tmp_path):
    """Gemma 3's Hub checkpoints (transformers 4) nest the tower under `vision_tower.vision_model.`, and
    transformers 5 holds `model.language_model.*` etc. in memory: either layout imports under the
    tables' names as the same model."""
    from safetensors.torch import load_file

    from mrl.weights import Exporter

    saved = load_file(checkpoint / "model.safetensors")
    hub = (("vision_tower.", "vision_tower.vision_model."),)
    memory = (("language_model.model.", "model.language_model."), ("vision_tower.", "model.vision_tower."),
              ("multi_modal_projector.", "model.multi_modal_projector."))
    for i, moves in enumerate((hub, memory)):
        def moved(name):
            return next((new + name[len(old):] for old, new in moves if name.startswith(old)), name)

        d = tmp_path / str(i)
        d.mkdir()
        save_file({moved(n): t for n, t in saved.items()}, d / "model.safetensors", metadata={"format": "pt"})
        shutil.copy(checkpoint / "config.json", d / "config.json")
        assert moved("vision_tower.post_layernorm.weight") in load_file(d / "model.safetensors")
        hf, model = _megatron(d)
        stream = dict(Exporter([model], hf).stream())
        assert set(stream) == set(saved) and all(torch.equal(stream[n], t) for n, t in saved.items())


def test_preset_facts_and_refusals(platform):
    from types import SimpleNamespace

    from mrl.errors import UserError
    from mrl.models.config import ModelConfig
    from mrl.models.facts import find_hf_config, model_facts
    from mrl.models.megatron import architecture_problems, hf_config, model_backend
    from mrl.models.vlm import nested, training_problem
    from mrl.weights.sync_plan import hf_tensors

    hf = hf_config(ModelConfig(path="builtin:tiny-gemma3-vl"))
    assert hf["model_type"] == "gemma3" and hf["hidden_size"] == 128 and hf["mm_tokens_per_image"] == 4
    assert (hf["image_token_id"], hf["boi_token_id"], hf["eoi_token_id"]) == (260, 259, 261)
    assert hf["vision_config"]["image_size"] == 56 and hf["layer_types"] == ["sliding_attention", "full_attention"]
    back = nested(find_hf_config("builtin:tiny-gemma3-vl")[0])
    assert back["text_config"]["model_type"] == "gemma3_text" and back["image_token_index"] == 260
    facts = model_facts("builtin:tiny-gemma3-vl")
    assert (facts.num_layers, facts.num_attention_heads, facts.num_query_groups, facts.vocab_size) == (2, 4, 2, 512)
    assert architecture_problems(find_hf_config("builtin:tiny-gemma3-vl")[0]) == []
    # the tensors mrl plan sizes the sync from: the text model nested, the tower and projector
    names = {t.name for t in hf_tensors(find_hf_config("builtin:tiny-gemma3-vl")[0])}
    assert {"language_model.model.layers.1.post_feedforward_layernorm.weight",
            "multi_modal_projector.mm_soft_emb_norm.weight", "vision_tower.post_layernorm.weight"} <= names
    assert model_backend(hf, "auto", "cpu") == "sdpa" and model_backend(hf, "auto", "cuda") == "sdpa"
    with pytest.raises(UserError, match="model.attention: 'varlen' cannot run gemma3's bidirectional image attention"):
        model_backend(hf, "varlen", "cuda")

    def spec(engine, attention="auto"):
        return SimpleNamespace(rollout=SimpleNamespace(engine=engine), parallel=SimpleNamespace(context=1),
                               distill=SimpleNamespace(model_path=None), model=SimpleNamespace(attention=attention))

    assert training_problem(spec("hf"), hf) is None and training_problem(spec("hf", "sdpa"), hf) is None
    assert training_problem(spec("hf", "te"), hf) == ("model.attention: 'te' cannot run gemma3's bidirectional image "
                                                    "attention (each image's tokens see each other); use 'sdpa' or 'auto'")
    assert training_problem(spec("vllm"), hf).startswith("model.path: gemma3 (vision-language) does not run with "
                                                         "rollout.engine = 'vllm'")


def test_hf_engine_logprobs_with_images_equal_the_trainer(platform, checkpoint):
    """The hf engine samples from the two image prompts (the images' `token_type_ids` in its
    prefill, placeholders never sampled); the trainer's own path (a Batch whose prompt items carry
    their images, packed by the Engine) scores the same tokens within 1e-4 (the step-1 audit)."""
    from types import SimpleNamespace

    from mrl.engine.engine import Engine
    from mrl.rollout.hf import HFEngine
    from mrl.rollout.types import Sampling
    from tests.weights.vlm_archs import gemma3_image_prompt_inputs

    hf, model = _megatron(checkpoint)
    prompts, inputs = gemma3_image_prompt_inputs(hf)
    eng = HFEngine.from_pretrained(str(checkpoint), seed=0)
    resp = eng.generate(prompts, Sampling(n=2, temperature=1.0, max_tokens=8, seed=5, ignore_eos=True), images=inputs)
    banned = {hf["image_token_id"], hf["boi_token_id"], hf["eoi_token_id"]}
    assert not banned & {t for r in resp for t in r.token_ids}
    items = [SimpleNamespace(images=x) for x in inputs]
    worst, out = trainer_audit(model, hf, prompts, resp, items)
    print(f"gemma3 AUDIT max |rollout - trainer| log-prob {worst:.3e}")
    assert worst <= 1e-4, worst
    assert torch.isfinite(out["entropy"]).all()


def test_validate_takes_a_gemma3_job_and_refuses_what_train_would(capsys):
    """The VLM quickstart with the preset validates; vLLM and a backend without the image blocks
    are one line each at `mrl validate`, under their keys."""
    from mrl.cli import main

    job = ["validate", "jobs/quickstart_vlm_cpu.toml", "model.path=builtin:tiny-gemma3-vl"]
    assert main(job) == 0
    capsys.readouterr()
    assert main(job + ["rollout.engine=vllm"]) == 2
    err = capsys.readouterr().err
    assert "model.path: gemma3 (vision-language) does not run with rollout.engine = 'vllm'" in err
    assert main(job + ["model.attention=flex", "platform.device=cuda"]) == 2
    assert "model.attention: 'flex' cannot run gemma3's bidirectional image attention" in capsys.readouterr().err


def test_image_processor_of_the_preset():
    """Any image becomes one 56x56 picture of `mm_tokens_per_image` (4) tokens, no grid and no
    mRoPE ids; the mark expands to the byte tokenizer's start, 4 image tokens, end (ids 259-261)."""
    import io

    from PIL import Image

    from mrl.data.images import model_image_processor
    from mrl.models.config import ModelConfig
    from mrl.models.megatron import hf_config
    from mrl.models.tokenizer import byte_tokenizer

    hf = hf_config(ModelConfig(path="builtin:tiny-gemma3-vl"))
    proc = model_image_processor("builtin:tiny-gemma3-vl", hf)
    buf = io.BytesIO()
    Image.new("RGB", (70, 50), (10, 200, 30)).save(buf, format="PNG")
    cells = [{"bytes": buf.getvalue(), "path": None}] * 2
    out = proc.process(cells, "<image>a<image>")
    assert out.pixel_values.shape == (2, 3, 56, 56) and out.image_grid_thw is None and out.tokens_per_image == (4, 4)
    ids = byte_tokenizer(vision=True)(proc.expand("<image>a<image>", out))["input_ids"]
    assert ids == [259, 260, 260, 260, 260, 261, ord("a"), 259, 260, 260, 260, 260, 261]
    assert proc.with_positions(out, ids) is out


def test_pan_and_scan_is_refused_by_the_check_validate_and_train_share(tmp_path):
    """A checkpoint whose preprocessor_config.json asks for pan-and-scan crops is one line from
    `vlm.training_problem` (what `mrl validate` and `mrl train` both call), before any image
    processor loads; with the crops off, or for a preset, there is nothing to say."""
    from types import SimpleNamespace

    from mrl.models.facts import find_hf_config
    from mrl.models.vlm import training_problem

    hf = find_hf_config("builtin:tiny-gemma3-vl")[0]

    def spec(path):
        return SimpleNamespace(model=SimpleNamespace(path=str(path), attention="auto"),
                               rollout=SimpleNamespace(engine="hf"), parallel=SimpleNamespace(context=1),
                               actor=SimpleNamespace(vision=None), distill=None)

    (tmp_path / "preprocessor_config.json").write_text('{"do_pan_and_scan": true}')
    problem = training_problem(spec(tmp_path), hf)
    assert problem is not None and "do_pan_and_scan" in problem and "\n" not in problem
    (tmp_path / "preprocessor_config.json").write_text('{"do_pan_and_scan": false}')
    assert training_problem(spec(tmp_path), hf) is None
    assert training_problem(spec("builtin:tiny-gemma3-vl"), hf) is None
