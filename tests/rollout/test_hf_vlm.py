"""The hf engine generating with images (Qwen2.5-VL): placeholders never sampled, rows computed as
alone, and its log-probs equal the megatron trainer's on the same image prompts (the step-1 audit)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from mrl.rollout.hf import HFEngine
from mrl.rollout.types import Sampling, prompt_seed
from tests.weights.vlm_archs import image_prompt_inputs, make_vlm


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from mrl.models.megatron import complete_hf_config

    d = tmp_path_factory.mktemp("vl")
    make_vlm(d)
    hf = complete_hf_config(json.loads((d / "config.json").read_text()))
    # prompt 0 has image 0, prompt 1 images 1 and 2; patches per image from its grid
    prompts, inputs = image_prompt_inputs(hf)
    return d, hf, prompts, inputs


def test_rows_as_alone_and_placeholders_never_sampled(vlm):
    d, hf, prompts, inputs = vlm
    eng = HFEngine.from_pretrained(str(d), seed=0)
    sampling = Sampling(n=2, temperature=1.0, max_tokens=6, seed=3, ignore_eos=True)
    both = eng.generate(prompts, sampling, images=inputs)
    alone = eng.generate(prompts[1:], sampling, prompt_seeds=[prompt_seed(3, 1)], images=inputs[1:])
    assert [r.token_ids for r in both[2:]] == [r.token_ids for r in alone]
    assert all(abs(a - b) <= 1e-5 for r, s in zip(both[2:], alone) for a, b in zip(r.logprobs, s.logprobs))
    # make the image placeholder the model's favourite token: it is still never sampled
    with torch.no_grad():
        eng.model.lm_head.weight[hf["image_token_id"]] *= 0
        eng.model.lm_head.weight[hf["image_token_id"]] += eng.model.lm_head.weight.sum(0) * 50
    greedy = Sampling(temperature=0, max_tokens=4, ignore_eos=True)
    banned = {hf[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    assert not banned & {t for r in eng.generate(prompts, greedy, images=inputs) for t in r.token_ids}
    eng.banned = eng.banned[:0]   # without the ban it is what the model picks
    assert hf["image_token_id"] in {t for r in eng.generate(prompts, greedy, images=inputs) for t in r.token_ids}


def test_rollout_logprobs_equal_megatron_trainer(vlm):
    """Sampled responses (temperature 1, log-probs of the sampled distribution: placeholders banned)
    re-scored by the megatron model (whose policy bans them too) on one packed row with the same
    images and mRoPE ids: within 1e-4 (the step-1 audit bound)."""
    from mrl import platform as plat
    from mrl.engine.packing import _thd_params
    from mrl.models.roles import build_role_model
    from mrl.models.vlm import packed_mrope_position_ids
    from mrl.platform.config import ParallelConfig, PlatformConfig
    from mrl.weights import load_hf_checkpoint

    d, hf, prompts, inputs = vlm
    eng = HFEngine.from_pretrained(str(d), seed=0)
    resp = eng.generate(prompts, Sampling(n=2, temperature=1.0, max_tokens=8, seed=5, ignore_eos=True),
                        images=inputs)
    plat.setup(PlatformConfig(device="cpu", ranks_per_node=1, cpu_threads=1), ParallelConfig(), seed=11)
    try:
        model = build_role_model("actor", hf, ParallelConfig(), dtype="float32", device="cpu")
        load_hf_checkpoint([model], d, hf)
        model.eval()
        seqs = [torch.tensor(prompts[r.prompt_index] + r.token_ids) for r in resp]
        imgs = [inputs[r.prompt_index] for r in resp]
        pos = packed_mrope_position_ids(hf, seqs, [x.image_grid_thw for x in imgs])
        with torch.no_grad():
            logits = model(torch.cat(seqs).unsqueeze(0), pos, None,
                           packed_seq_params=_thd_params([len(s) for s in seqs], "cpu"),
                           pixel_values=torch.cat([x.pixel_values for x in imgs]),
                           image_grid_thw=torch.cat([x.image_grid_thw for x in imgs]))[0, :, : hf["vocab_size"]]
        logp = torch.log_softmax(logits.float(), -1)
        worst, start = 0.0, 0
        for s, r in zip(seqs, resp):
            p = len(s) - len(r.token_ids)
            ours = logp[start + p - 1: start + len(s) - 1].gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0]
            worst = max(worst, (ours - torch.tensor(r.logprobs)).abs().max().item())
            start += len(s)
        print(f"AUDIT max |rollout - trainer| log-prob {worst:.3e}")
        assert worst <= 1e-4, worst

        # the trainer's own path: a Batch whose prompt items carry their images, packed into
        # micro-batches (mRoPE ids and images per row) and run by the Engine (entropy and all)
        from types import SimpleNamespace

        from mrl.batch import Batch
        from mrl.engine.engine import Engine
        from mrl.engine.objectives import actor_outputs
        from mrl.models.vlm import mrope_position_ids

        items = [SimpleNamespace(images=replace(x, prompt_positions=mrope_position_ids(
            hf, torch.tensor([p]), x.image_grid_thw)[:, 0])) for p, x in zip(prompts, inputs)]
        batch = Batch.from_sequences([prompts[r.prompt_index] for r in resp], [r.token_ids for r in resp],
                                     pad_id=256)
        batch = Batch(batch.tensors, {"prompt_item": [items[r.prompt_index] for r in resp]})
        out = Engine([model], name="actor").forward_only(
            batch, actor_outputs(1.0, entropy=True, vocab_size=hf["vocab_size"]), micro_batch_tokens=40)
        for i, r in enumerate(resp):
            n = len(r.token_ids)
            assert (out["logprobs"][i, :n] - torch.tensor(r.logprobs)).abs().max().item() <= 1e-4
        assert torch.isfinite(out["entropy"]).all()
    finally:
        plat.teardown()
