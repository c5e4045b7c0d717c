"""`mrl generate` with images (a vision-language model): a prompts file's `images` and the job's
own image data reach the engine with their prompts, processed as training processes its data."""
from __future__ import annotations

import json

import pytest

from tests.cli.test_cli import REPO

ONE_RANK = ["platform.ranks_per_node=1", "parallel.tensor=1", "reward.workers=1"]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    """The tiny Qwen2.5-VL, random, saved with its processor and tokenizer files (what mrl merge writes)."""
    from mrl.merge.assets import write_processor, write_tokenizer
    from tests.weights.vlm_archs import make_vlm

    d = tmp_path_factory.mktemp("vl")
    make_vlm(d)
    write_processor(d, "builtin:tiny-qwen2.5-vl", json.loads((d / "config.json").read_text()))
    write_tokenizer(d, "builtin:tiny-qwen2.5-vl")
    return d


def test_generate_answers_image_prompts_with_their_images(vl_dir, tmp_path):
    """Greedy rows equal the hf engine's answer to the same prompt with the same processed image;
    the red and the blue picture get different answers; `--from-data` takes the job's image rows;
    an image prompt to a text model, or a missing image file, is one line."""
    from PIL import Image

    from mrl.config.loader import load
    from mrl.data.images import model_image_processor
    from mrl.errors import UserError
    from mrl.models.megatron import hf_config
    from mrl.models.tokenizer import load_tokenizer
    from mrl.offline.generate import FromData, SamplingOverrides, generate_rows, read_requests
    from mrl.offline.target import Target
    from mrl.rollout.hf import HFEngine
    from mrl.rollout.types import Sampling

    Image.new("RGB", (56, 56), (200, 30, 30)).save(tmp_path / "red.png")
    Image.new("RGB", (70, 60), (30, 30, 200)).save(tmp_path / "blue.png")
    question = "<image>Colour? 1 = red, 2 = blue:"
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": question, "images": ["red.png"], "answer": "1"}) + "\n" +
                    json.dumps({"prompt": question, "images": [str(tmp_path / "blue.png")], "answer": "2"}) + "\n")
    spec, _ = load(REPO / "jobs/quickstart_vlm_cpu.toml", [f"job.output_dir={tmp_path}", f"model.path={vl_dir}",
                                                           *ONE_RANK])
    greedy = SamplingOverrides(temperature=0.0, max_tokens=6)
    rows = generate_rows(Target(spec, None, 0), read_requests(path), greedy)
    assert [r["answer"] for r in rows] == ["1", "2"] and all("score" in r for r in rows)

    tok = load_tokenizer(spec.model)
    proc = model_image_processor(str(vl_dir), hf_config(spec.model))
    eng = HFEngine.from_pretrained(str(vl_dir), seed=0)
    want = []
    for image in ("red.png", "blue.png"):
        x = proc.process([str(tmp_path / image)], question)
        ids = tok.encode(proc.expand(question, x), add_special_tokens=False)
        [r] = eng.generate([ids], Sampling(temperature=0.0, max_tokens=6, ignore_eos=False),
                           images=[proc.with_positions(x, ids)])
        want.append(tok.decode(r.token_ids, skip_special_tokens=True))
    assert [r["response"] for r in rows] == want
    assert want[0] != want[1]

    data = generate_rows(Target(spec, None, 0), FromData(count=3, split="train"), greedy)
    assert len(data) == 3 and all(r["answer"] in ("1", "2") for r in data)

    text, _ = load(REPO / "jobs/quickstart_cpu.toml", [f"job.output_dir={tmp_path}", *ONE_RANK])
    with pytest.raises(UserError, match=f"prompt 0 has images, but {text.model.path} is not a vision-language model"):
        generate_rows(Target(text, None, 0), read_requests(path), greedy)
    path.write_text(json.dumps({"prompt": question, "images": ["gone.png"]}) + "\n")
    with pytest.raises(UserError, match="prompt 0: image file .*gone.png' not found"):
        generate_rows(Target(spec, None, 0), read_requests(path), greedy)
