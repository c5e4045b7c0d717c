"""`mrl sft` with images (the tiny Qwen3-VL): which tokens are trained, the images and mRoPE ids an
example carries, bad image rows, and a short run with a trainable tower that resumes exactly (slow)."""
from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.dist_util import REPO
from tests.sft.test_sft import history
from tests.train.test_train import run_jobs

JOB = REPO / "jobs/sft_vlm_cpu.toml"


def _png(colour, size=(56, 56), fmt="PNG"):
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format=fmt)
    return buf.getvalue()


def _chat(first, second="<image>And this one?", answer="2"):
    return [{"role": "user", "content": first}, {"role": "assistant", "content": "1"},
            {"role": "user", "content": second}, {"role": "assistant", "content": answer}]


@pytest.fixture(scope="module")
def vl():
    from mrl.data.images import model_image_processor
    from mrl.models.config import ModelConfig
    from mrl.models.megatron import hf_config
    from mrl.models.tokenizer import load_tokenizer

    model = ModelConfig(path="builtin:tiny-qwen3-vl")
    hf = hf_config(model)
    return hf, load_tokenizer(model), model_image_processor(model.path, hf)


def _load(tmp_path, rows, *overrides):
    from mrl.config.loader import load
    from mrl.sft.data import load_examples

    path = tmp_path / "vl.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    spec, _ = load(JOB, [f"data.train_files=['{path}']", "data.generator=null", "sft.val_every_steps=0", *overrides])
    return spec, path


def test_images_expand_in_order_are_never_trained_and_carry_whole_sequence_positions(vl, tmp_path):
    from mrl.models.vlm import mrope_position_ids
    from mrl.sft.data import load_examples, to_batch

    hf, tok, proc = vl
    rows = [{"messages": _chat("<image>Colour?"), "images": [{"bytes": _png("red"), "path": None},
                                                             {"bytes": _png("blue", (128, 64)), "path": None}]}]
    spec, _ = _load(tmp_path, rows)
    ex = load_examples(spec, tok, images=proc).examples[0]
    ids = ex.prompt_ids + ex.response_ids
    pad, start, end = (tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"))
    # 56x56 -> the 64x64 minimum: 4x4 patches, 4 tokens; 128x64: 8x4 patches, 8 tokens
    assert ex.images.image_grid_thw.tolist() == [[1, 4, 4], [1, 4, 8]] and ex.images.tokens_per_image == (4, 8)
    assert ids.count(pad) == 12 and ids.count(start) == ids.count(end) == 2
    # the first image is in the prompt, the second after the first trained token; only the answers train
    assert ex.prompt_ids.count(pad) == 4 and ex.response_ids.count(pad) == 8
    trained = tok.decode([t for t, m in zip(ex.response_ids, ex.loss_mask) if m])
    assert trained == "1<|im_end|>\n2<|im_end|>\n"
    assert not any(m and t in (pad, start, end) for t, m in zip(ex.response_ids, ex.loss_mask))
    # the mRoPE ids of the whole sequence, as the model's get_rope_index gives them
    want = mrope_position_ids(hf, torch.tensor([ids]), ex.images.image_grid_thw)[:, 0]
    assert torch.equal(ex.images.prompt_positions, want) and want.shape[1] == len(ids)
    # ... and the packed row takes them whole, with the row's images
    from mrl.engine.packing import pack

    batch = to_batch([ex], pad_id=tok.pad_token_id)
    mb = pack(batch, [0])
    assert torch.equal(mb.position_ids[:, 0, : len(ids)], want)
    assert torch.equal(mb.vision["pixel_values"], ex.images.pixel_values)


def test_bad_image_rows_are_one_line_counted_and_never_cut(vl, tmp_path, caplog):
    from mrl.errors import UserError
    from mrl.sft.data import load_examples

    hf, tok, proc = vl
    good = {"bytes": _png("red"), "path": None}
    rows = [{"messages": _chat("<image>Colour?"), "images": [good, good]},
            {"messages": _chat("<image>Colour?"), "images": [{"bytes": b"not a png", "path": None}, good]},
            {"messages": _chat("<image>Colour?"), "images": [good]},                                 # 2 marks, 1 image
            {"messages": _chat("<image>Colour?", answer="<image>"), "images": [good, good, good]},    # image to train on
            {"messages": _chat("<image>Colour?"), "images": [good, {"bytes": None, "path": "missing.png"}]}]
    spec, path = _load(tmp_path, rows)
    got = load_examples(spec, tok, images=proc)
    assert len(got) == 1 and got.stats["rows_bad_image_dropped"] == 4
    lines = [r.getMessage() for r in caplog.records if "row dropped" in r.getMessage()]
    assert any("row 1: image bytes cannot be decoded" in m for m in lines)
    assert any("row 2: 2 <image> mark(s) for 1 image(s)" in m for m in lines)
    assert any("row 3: an image in a trained (assistant) turn" in m for m in lines)
    assert any("row 4: image file 'missing.png' not found" in m for m in lines)
    spec, _ = _load(tmp_path, rows, "data.bad_rows=error")
    with pytest.raises(UserError, match=r"vl.parquet row 1: image bytes cannot be decoded"):
        load_examples(spec, tok, images=proc)
    # an example with images over sft.max_tokens is dropped even with truncation = 'right' (never cut)
    spec, _ = _load(tmp_path, rows[:1], "sft.max_tokens=40", "sft.truncation=right")
    with pytest.raises(UserError, match="no train examples left"):
        load_examples(spec, tok, images=proc)


def test_sft_vision_refusals(capsys):
    from types import SimpleNamespace

    from mrl.models.config import ModelConfig, VisionConfig
    from mrl.models.lora import LoraConfig
    from mrl.models.megatron import hf_config
    from mrl.models.vlm import sft_problem as image_problem

    def spec(trainable=True, context=1, rank=0):
        return SimpleNamespace(sft=SimpleNamespace(vision=VisionConfig(trainable=trainable), lora=LoraConfig(rank=rank),
                                                   recompute="none"),
                               parallel=SimpleNamespace(context=context))

    q3 = hf_config(ModelConfig(path="builtin:tiny-qwen3-vl"))
    assert image_problem(spec(), q3) is None
    assert image_problem(spec(), hf_config(ModelConfig(path="builtin:tiny-qwen2"))) == \
        "sft.vision.trainable: model_type 'qwen2' has no vision tower"
    assert "with sft.lora" in image_problem(spec(rank=8), q3)
    assert "parallel.context > 1" in image_problem(spec(trainable=False, context=2), q3)
    # mrl validate says the same, under the key
    from mrl.cli import main

    capsys.readouterr()
    assert main(["validate", str(JOB), "model.path=builtin:tiny-qwen2"]) == 2
    assert "sft.vision.trainable: model_type 'qwen2' has no vision tower" in capsys.readouterr().err


@pytest.mark.slow
def test_a_short_image_sft_run_trains_the_tower_and_resumes_exactly(tmp_path):
    """jobs/sft_vlm_cpu.toml on 1 rank, tower trainable: 3 steps straight = 2 steps, a checkpoint,
    and a resume to 3 (loss, grad norm); the loss falls. One process, three runs."""
    common = ("platform.ranks_per_node=1 parallel.tensor=1 data.generator_size=16 sft.examples_per_step=4 "
              "sft.val_every_steps=0 tracking.backends=['mlflow']")
    # only the first half of the resumed run saves (its step 2, the one the second half resumes)
    run_jobs(str(JOB), tmp_path / "runs", f"{common} sft.total_steps=3 checkpoint.every_steps=-1 job.name=straight",
             f"{common} sft.total_steps=2 checkpoint.every_steps=2 job.name=resumed",
             f"{common} sft.total_steps=3 checkpoint.every_steps=-1 job.name=resumed")
    straight, resumed = history(tmp_path / "runs/straight"), history(tmp_path / "runs/resumed")
    for key in ("train/loss", "train/grad_norm"):
        assert straight[key] == resumed[key], (key, straight[key], resumed[key])
    loss = straight["train/loss"]
    assert loss[3] < loss[1], loss
    print(f"SFT-VLM loss {loss}")
