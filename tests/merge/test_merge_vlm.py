"""`mrl merge` of a vision-language checkpoint (the tiny Qwen2.5-VL and Qwen3-VL saved at TP=2): transformers
loads the output with its processor, and it answers an image prompt as the hf engine does (slow:
shares the merge fixtures' one torchrun launch)."""
from __future__ import annotations

import io

import pytest
import torch
from safetensors.torch import load_file


@pytest.mark.slow
@pytest.mark.parametrize("case, preset, tower", [("vl_preset_tp2", "tiny-qwen2.5-vl", "visual."),
                                                 ("vl3_preset_tp2", "tiny-qwen3-vl", "model.visual.")])
def test_vlm_merge_loads_with_its_processor_and_answers_like_the_engine(saved, tmp_path, capsys, case, preset, tower):
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from mrl.cli import main
    from mrl.data.images import ImageProcessor
    from mrl.models.config import ModelConfig
    from mrl.models.megatron import hf_config
    from mrl.data.images import model_image_processor as image_processor
    from mrl.rollout.hf import HFEngine
    from mrl.rollout.types import Sampling

    root, _, expected = saved[case]
    out = tmp_path / "vl"
    assert main(["merge", str(root), str(out)]) == 0
    assert "verified logits" in capsys.readouterr().out
    got = load_file(str(next(out.glob("model-*.safetensors"))))
    assert set(got) == set(expected) and all(torch.equal(got[k], v) for k, v in expected.items())
    assert any(k.startswith(tower) for k in got)
    # the processor and tokenizer the job used come back from the output directory
    hf = hf_config(ModelConfig(path=f"builtin:{preset}"))
    ours = image_processor(f"builtin:{preset}", hf)
    loaded = ImageProcessor(AutoImageProcessor.from_pretrained(out), ours.tokens)
    buf = io.BytesIO()
    Image.new("RGB", (70, 50), (10, 200, 30)).save(buf, format="PNG")
    cell = {"bytes": buf.getvalue(), "path": None}
    a, b = ours.process([cell], "<image>"), loaded.process([cell], "<image>")
    assert torch.equal(a.pixel_values, b.pixel_values) and torch.equal(a.image_grid_thw, b.image_grid_thw)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok(ours.expand("<image>Colour?", a))["input_ids"]
    assert ids.count(hf["image_token_id"]) == a.tokens_per_image[0]
    # transformers' greedy answer to the image prompt equals the hf engine's on the same weights
    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model).__name__.lower().replace("_", "").startswith(hf["model_type"].replace("_", ""))
    engine = HFEngine.from_pretrained(str(out))
    mine = engine.generate([ids], Sampling(temperature=0, max_tokens=6, ignore_eos=True), images=[a])[0].token_ids
    x = torch.tensor([ids])
    with torch.no_grad():
        theirs = model.generate(input_ids=x, attention_mask=torch.ones_like(x), pixel_values=a.pixel_values,
                                image_grid_thw=a.image_grid_thw, mm_token_type_ids=(x == hf["image_token_id"]).int(),
                                max_new_tokens=6, do_sample=False, min_new_tokens=6,
                                bad_words_ids=[[hf[k]] for k in ("image_token_id", "video_token_id",
                                                                "vision_start_token_id", "vision_end_token_id")])
    assert mine == theirs[0, len(ids):].tolist()


@pytest.mark.slow
def test_gemma3_vlm_merge_loads_and_answers_like_the_engine(saved, tmp_path, capsys):
    """The tiny multimodal Gemma 3 saved at TP=2: `mrl merge` writes the trainer's tensors bit for
    bit (tower and projector included) with its image processor, and transformers' greedy answer
    to an image prompt (its images' `token_type_ids` given) equals the hf engine's."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from mrl.cli import main
    from mrl.data.images import ImageProcessor, model_image_processor
    from mrl.models.config import ModelConfig
    from mrl.models.megatron import hf_config
    from mrl.rollout.hf import HFEngine
    from mrl.rollout.types import Sampling

    root, _, expected = saved["gemma3vl_preset_tp2"]
    out = tmp_path / "gemma3"
    assert main(["merge", str(root), str(out)]) == 0
    assert "verified logits" in capsys.readouterr().out
    got = load_file(str(next(out.glob("model-*.safetensors"))))
    assert set(got) == set(expected) and all(torch.equal(got[k], v) for k, v in expected.items())
    assert any(k.startswith("vision_tower.") for k in got) and any(k.startswith("multi_modal_projector.") for k in got)
    hf = hf_config(ModelConfig(path="builtin:tiny-gemma3-vl"))
    ours = model_image_processor("builtin:tiny-gemma3-vl", hf)
    loaded = ImageProcessor(AutoImageProcessor.from_pretrained(out), ours.tokens,
                            tokens_per_image=hf["mm_tokens_per_image"])
    buf = io.BytesIO()
    Image.new("RGB", (70, 50), (10, 200, 30)).save(buf, format="PNG")
    cell = {"bytes": buf.getvalue(), "path": None}
    a, b = ours.process([cell], "<image>"), loaded.process([cell], "<image>")
    assert torch.equal(a.pixel_values, b.pixel_values) and a.pixel_values.shape == (1, 3, 56, 56)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok(ours.expand("<image>Colour?", a))["input_ids"]
    assert ids.count(hf["image_token_id"]) == a.tokens_per_image[0] == 4
    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    engine = HFEngine.from_pretrained(str(out))
    mine = engine.generate([ids], Sampling(temperature=0, max_tokens=6, ignore_eos=True), images=[a])[0].token_ids
    x = torch.tensor([ids])
    with torch.no_grad():
        theirs = model.generate(input_ids=x, attention_mask=torch.ones_like(x), pixel_values=a.pixel_values,
                                token_type_ids=(x == hf["image_token_id"]).long(), max_new_tokens=6, do_sample=False,
                                min_new_tokens=6,
                                bad_words_ids=[[hf[k]] for k in ("image_token_id", "boi_token_id", "eoi_token_id")])
    assert mine == theirs[0, len(ids):].tolist()
