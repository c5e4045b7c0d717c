"""verl's multimodal rows -> processed images and expanded placeholder tokens (`mrl.data.images`)."""
from __future__ import annotations

import io
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from mrl.data.config import DataConfig
from mrl.data.source import load_prompts
from mrl.errors import UserError


def _png(w, h, color):
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vl():
    from mrl.models.config import ModelConfig
    from mrl.models.megatron import hf_config
    from mrl.models.tokenizer import load_tokenizer
    from mrl.data.images import model_image_processor as image_processor

    model = ModelConfig(path="builtin:tiny-qwen2.5-vl")
    hf = hf_config(model)
    return hf, load_tokenizer(model), image_processor(model.path, hf)


def _write(tmp_path, rows):
    path = tmp_path / "vl.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_verl_rows_expand_placeholders_and_carry_processor_outputs(vl, tmp_path):
    hf, tok, proc = vl
    (tmp_path / "red.png").write_bytes(_png(56, 56, "red"))
    rows = [
        # <image> in the text, the image as verl's {bytes, path} table with bytes
        dict(prompt=[{"role": "user", "content": "<image>How many?"}], images=[{"bytes": _png(112, 56, "blue"), "path": None}],
             reward_model={"ground_truth": "1"}),
        # a chat image part, the image by path
        dict(prompt=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Color?"}]}],
             images=[{"bytes": None, "path": str(tmp_path / "red.png")}], reward_model={"ground_truth": "red"}),
    ]
    # parquet cannot hold a column of mixed content types: the chat-part row goes through records
    from mrl.data.prompts import tokenize_rows
    from mrl.data.rows import Columns, rows_from_records

    prows = rows_from_records(rows, columns=Columns(answer="reward_model.ground_truth"), default_source="t", where="t")
    ds = tokenize_rows(prows, tok, max_prompt_tokens=256, overflow="drop", chat_template=True, images=proc)
    pad, start, end = (tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"))
    assert (pad, start, end) == (hf["image_token_id"], hf["vision_start_token_id"], hf["vision_end_token_id"])
    blue, red = ds.items
    # 112x56 pixels: an 8x4 patch grid, 2x2 merged to 8 tokens; 56x56: 4x4 patches, 4 tokens
    assert blue.images.image_grid_thw.tolist() == [[1, 4, 8]] and blue.images.tokens_per_image == (8,)
    assert red.images.image_grid_thw.tolist() == [[1, 4, 4]] and red.images.tokens_per_image == (4,)
    for item, n in ((blue, 8), (red, 4)):
        ids = list(item.token_ids)
        assert ids.count(pad) == n and ids.count(start) == ids.count(end) == 1
        assert ids[ids.index(start) + 1: ids.index(end)] == [pad] * n
        assert "images" not in item.extra
    assert red.text.startswith("<|im_start|>user\n<|vision_start|>") and "Color?" in red.text
    # the pixels are the processor's own for the decoded image
    from PIL import Image

    want = proc.processor(images=[Image.open(tmp_path / "red.png").convert("RGB")], return_tensors="pt")["pixel_values"]
    assert torch.equal(red.images.pixel_values, want)


def test_bad_images_are_one_line_and_counted(vl, tmp_path, caplog):
    hf, tok, proc = vl
    good = _png(56, 56, "green")
    rows = [
        dict(prompt="<image>a", images=[{"bytes": b"not an image", "path": None}], answer="x"),
        dict(prompt="<image>b", images=[{"bytes": None, "path": str(tmp_path / "nope.png")}], answer="x"),
        dict(prompt="<image><image>c", images=[{"bytes": good, "path": None}], answer="x"),
        dict(prompt="d", images=[{"bytes": good, "path": None}], answer="x"),
        dict(prompt="<image>e " + "y" * 300, images=[{"bytes": good, "path": None}], answer="x"),   # over the limit
        dict(prompt="<image>ok", images=[{"bytes": good, "path": None}], answer="x"),
    ]
    path = _write(tmp_path, rows)
    cfg = DataConfig(train_files=(path,), max_prompt_tokens=64, prompt_overflow="truncate_left")
    ds = load_prompts(cfg, tok, "train", images=proc)
    assert [i.prompt for i in ds.items] == ["<image>ok"]
    assert ds.stats["prompts_bad_image_dropped"] == 4 and ds.stats["prompts_overlong_dropped"] == 1
    lines = [r.getMessage() for r in caplog.records if "row dropped" in r.getMessage()]
    assert len(lines) == 4 and all("\n" not in m for m in lines)
    assert "cannot be decoded" in lines[0] and "not found" in lines[1] and "2 <image> mark(s) for 1 image(s)" in lines[2]
    with pytest.raises(UserError, match=r"vl.parquet row 0: image bytes cannot be decoded"):
        load_prompts(DataConfig(train_files=(path,), bad_rows="error"), tok, "train", images=proc)


def test_text_models_leave_the_images_column_alone(tmp_path):
    from mrl.models.tokenizer import byte_tokenizer

    path = _write(tmp_path, [dict(prompt="<image>a", images=[{"bytes": b"x", "path": None}], answer="1")])
    ds = load_prompts(DataConfig(train_files=(path,)), byte_tokenizer(), "train")
    assert ds.items[0].images is None and "images" in ds.items[0].extra


def test_packed_row_carries_mrope_ids_and_images_by_hand():
    """Two responses packed in one row (plus 2 padding tokens): the image prompt keeps its own
    mRoPE ids and its response counts on from one past their largest; the text prompt gets the
    same id thrice; the row's images are the image prompt's."""
    from types import SimpleNamespace

    from mrl.batch import Batch
    from mrl.data.images import ImageInputs
    from mrl.engine.packing import pack

    pix, grid = torch.randn(16, 8), torch.tensor([[1, 4, 4]])
    img = ImageInputs(pix, grid, (4,), prompt_positions=torch.tensor([[0, 1, 1, 1, 1, 3], [0, 1, 1, 2, 2, 3],
                                                                      [0, 1, 2, 1, 2, 3]]))
    items = [SimpleNamespace(images=img), SimpleNamespace(images=None)]
    batch = Batch.from_sequences([[5, 9, 9, 9, 9, 6], [7, 8]], [[1, 2], [3]])
    batch = Batch(batch.tensors, {"prompt_item": items})
    mb = pack(batch, [0, 1], pad_to_multiple=4)
    assert mb.position_ids.shape == (3, 1, 12)
    assert mb.position_ids[:, 0].tolist() == [[0, 1, 1, 1, 1, 3, 4, 5, 0, 1, 2, 0],
                                              [0, 1, 1, 2, 2, 3, 4, 5, 0, 1, 2, 0],
                                              [0, 1, 2, 1, 2, 3, 4, 5, 0, 1, 2, 0]]
    assert torch.equal(mb.vision["pixel_values"], pix) and mb.vision["image_grid_thw"].tolist() == [[1, 4, 4]]
    text_only = Batch(batch.tensors, {"prompt_item": [SimpleNamespace(images=None)] * 2})
    assert pack(text_only, [0, 1]).vision == {} and pack(text_only, [0, 1]).position_ids.dim() == 2


def test_an_image_is_bounded_in_bytes_and_declared_pixels_before_it_is_decoded(tmp_path, monkeypatch):
    """A small PNG declaring a canvas over the pixel cap, and a file over the byte cap, are each a
    `BadImage` naming the bound (nothing decoded, the file not read past the cap)."""
    import io

    from PIL import Image

    from mrl.data import images

    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 63)
    with pytest.raises(images.BadImage, match="8x8 pixels, more than 63"):
        images.decode_image(buf.getvalue())
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 64)
    assert images.decode_image(buf.getvalue()).size == (8, 8)
    big = tmp_path / "big.png"
    big.write_bytes(buf.getvalue() + b"\0" * 100)
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", len(buf.getvalue()) + 99)
    with pytest.raises(images.BadImage, match="image of more than"):
        images.decode_image({"path": str(big)})


def test_kept_images_are_what_the_processor_turned_into_pixels(vl):
    """An image the processor must resize (90x50 -> 84x56) is kept at that size; processing the kept
    image again gives the same pixel values and grid bit for bit (vLLM's processor gets it), and
    they equal the processor's own output for the original image."""
    import numpy as np
    from PIL import Image

    from mrl.data.images import PLACEHOLDER

    _, _, proc = vl
    rng = np.random.RandomState(0)
    original = Image.fromarray((rng.rand(50, 90, 3) * 255).astype("uint8"))
    buf = io.BytesIO()
    original.save(buf, format="PNG")
    out = proc.process([buf.getvalue()], f"{PLACEHOLDER} how many?")
    assert [im.size for im in out.images] == [(84, 56)]
    assert out.image_grid_thw.tolist() == [[1, 4, 6]] and out.tokens_per_image == (6,)
    again = proc.processor(images=list(out.images), return_tensors="pt")
    assert torch.equal(again["pixel_values"], out.pixel_values)
    assert torch.equal(again["image_grid_thw"], out.image_grid_thw)
    direct = proc.processor(images=[original], return_tensors="pt")
    assert torch.equal(direct["pixel_values"], out.pixel_values)
