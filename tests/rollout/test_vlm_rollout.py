"""Images through the rollout paths (Qwen2.5-VL): vLLM's collapsed placeholders by hand (the
engine calls: tests/rollout/test_vllm_vlm.py), server mode and resumed trajectories on the hf
engine, multi-turn conversations and partial rollouts carrying their prompt's images on every call."""
from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from mrl.errors import UserError
from mrl.rollout.types import Sampling
from mrl.rollout.vision import allowed_token_ids, check_expanded, collapse_image_pads, vllm_prompt

START, PAD, END = 259, 260, 261


def test_image_pads_collapse_one_run_per_image_by_hand():
    ids = [5, START, PAD, PAD, PAD, PAD, END, 7, START, PAD, PAD, END, 9]
    assert collapse_image_pads(ids, PAD, (4, 2)) == [5, START, PAD, END, 7, START, PAD, END, 9]
    with pytest.raises(UserError, match=r"2 run\(s\) of \[4, 2\] pad tokens\) do not match its 2 image\(s\) of \[4, 3\]"):
        collapse_image_pads(ids, PAD, (4, 3))
    with pytest.raises(UserError, match="do not match its 1 image"):
        collapse_image_pads(ids, PAD, (4,))
    assert vllm_prompt([1, 2, 3], None, PAD) == {"prompt_token_ids": [1, 2, 3]}
    check_expanded(ids, ids)
    with pytest.raises(UserError, match="vLLM expanded an image prompt to 12 tokens, the data to 13"):
        check_expanded(ids[:-1], ids)
    assert allowed_token_ids(8, [2, 5]) == [0, 1, 3, 4, 6, 7] and allowed_token_ids(8, []) is None


# ------------------------------------------------------------------------------ the hf engine


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from mrl.models.megatron import complete_hf_config
    from mrl.rollout.hf import HFEngine
    from tests.weights.vlm_archs import image_prompt_inputs, make_vlm

    d = tmp_path_factory.mktemp("vl")
    make_vlm(d)
    hf = complete_hf_config(json.loads((d / "config.json").read_text()))
    prompts, inputs = image_prompt_inputs(hf)
    return HFEngine.from_pretrained(str(d), seed=0), prompts, inputs


def test_server_mode_and_a_resumed_trajectory_keep_their_images(vlm):
    """Server mode (`HFAsyncEngine` under the agent loop, 3 tokens a scheduler step): greedy
    trajectories give the spmd engine's tokens; a trajectory resumed from its first 4 tokens (a
    partial rollout carried over a step, as `server_round` rebuilds it) continues to the same 10.
    Without its images the same prompt gives other tokens, so the images were used."""
    from mrl.rollout.agent_loop import AgentRunner, Trajectory, TrajectorySpec
    from mrl.rollout.hf_async import HFAsyncEngine
    from mrl.rollout.router import Router

    eng, prompts, inputs = vlm
    greedy = Sampling(n=1, temperature=0.0, max_tokens=10, ignore_eos=True)
    want = eng.generate(prompts, greedy, images=inputs)
    runner = AgentRunner(Router([HFAsyncEngine(eng, tick_tokens=3)]))
    specs = [TrajectorySpec(f"t{i}", i, p, seed=1, images=x) for i, (p, x) in enumerate(zip(prompts, inputs))]
    got = asyncio.run(runner.run(specs, greedy)).trajectories
    assert [t.token_ids for t in got] == [r.token_ids for r in want]
    assert all(abs(a - b) < 1e-5 for t, r in zip(got, want) for a, b in zip(t.logprobs, r.logprobs))
    part = want[1]
    resumed = TrajectorySpec("t1r", 1, prompts[1], seed=1, images=inputs[1],
                             resume=Trajectory(part.token_ids[:4], part.logprobs[:4], [1] * 4))
    [t] = asyncio.run(runner.run([resumed], greedy)).trajectories
    assert t.token_ids == part.token_ids
    assert eng.generate(prompts[1:], greedy, images=[replace(inputs[1], pixel_values=inputs[1].pixel_values * 0)]
                        )[0].token_ids != part.token_ids


def test_partial_rollouts_carry_the_prompts_images(vlm):
    """`mrl.train.rollout.advance` (partial rollouts, 3 tokens a round): each call sends the prompt's
    images with prompt + tokens so far, and the greedy result equals one whole call."""
    from mrl.train.rollout import advance
    from mrl.train.groups import GroupInProgress

    eng, prompts, inputs = vlm
    greedy = Sampling(n=1, temperature=0.0, max_tokens=9, ignore_eos=True)
    want = eng.generate(prompts, greedy, images=inputs)
    calls = []

    class Recording:
        def generate(self, ids, sampling, images=None, **kw):
            calls.append(images)
            return eng.generate(ids, replace(sampling, temperature=0.0, ignore_eos=True), images=images, **kw)

    roll = SimpleNamespace(max_response_tokens=9, responses_per_prompt=1, do_sample=False, temperature=0.0, top_p=1.0, top_k=-1,
                           min_p=0.0, repetition_penalty=1.0, stop_token_ids=[], ignore_eos=True,
                           logprobs_mode="processed_logprobs", generate_timeout_s=60.0, seed=0)
    run = SimpleNamespace(spec=SimpleNamespace(rollout=roll), separate=False)
    gen = SimpleNamespace(generator=Recording(), groups=None, is_leader=True, mp_group=None)
    items = [SimpleNamespace(token_ids=p, images=x, index=i) for i, (p, x) in enumerate(zip(prompts, inputs))]
    active = [GroupInProgress.new(it, 1, 0) for it in items]
    st = {"generated": 0, "tokens": 0}
    while any(f is None for g in active for f in g.finish):
        advance(run, gen, active, 3, 5, 0, st)
    assert [g.tokens[0] for g in active] == [r.token_ids for r in want]
    assert len(calls) == 3 and all(c == inputs for c in calls)


def test_multi_turn_sends_the_prompts_images_with_every_assistant_turn():
    """A tool-calling conversation (`MultiTurnRollout`): each assistant turn's call carries the
    prompt's images; a text prompt beside it gets None."""
    from mrl.rollout.tools import ToolRunner
    from tests.rollout.test_multi_turn import TOK, TOOLS, ScriptedEngine, call

    seen = []

    class Engine(ScriptedEngine):
        def generate(self, prompt_token_ids, sampling, prompt_seeds=None, images=None):
            seen.append(images)
            return super().generate(prompt_token_ids, sampling)

    from mrl.rollout.multi_turn import MultiTurnRollout

    mt = MultiTurnRollout(Engine([call("echo", text="hi"), "done<|im_end|>"]), TOK,
                          ToolRunner([f"{TOOLS}:echo"], 5.0), max_assistant_turns=4)
    marker = object()
    out = mt.generate([TOK.encode("<|im_start|>user\nlook<|im_end|>\n<|im_start|>assistant\n"), [65]],
                      Sampling(n=1, max_tokens=400), images=[marker, None])
    assert out[0].info["tool_turns"] == 1 and out[0].info["assistant_turns"] == 2
    assert seen == [[marker, None], [marker, None]]


def test_engine_groups_send_each_prompts_kept_images_with_it():
    """Colocated vLLM (`generate_on_groups`, one rank): each prompt's images reach the engine with
    it, without the pixel values and mRoPE ids (vLLM computes its own); a text prompt gets None."""
    from mrl.data.images import ImageInputs
    from mrl.rollout.plan import EngineGroups
    from mrl.rollout.types import Response
    from mrl.train.engine_groups import generate_on_groups

    seen = {}

    class Generator:
        def generate(self, prompts, sampling, prompt_seeds=None, images=None):
            seen["images"] = images
            return [Response(i, [5], [-1.0], "length") for i in range(len(prompts)) for _ in range(sampling.n)]

    picture = object()
    x = ImageInputs(pixel_values=torch.ones(4, 2), image_grid_thw=torch.tensor([[1, 2, 2]]), tokens_per_image=(1,),
                    prompt_positions=torch.zeros(3, 4), images=(picture,))
    out = generate_on_groups(Generator(), EngineGroups(1, 1), 0, 1, [[1, 2], [3]], Sampling(n=2, max_tokens=1),
                             images=[x, None])
    sent = seen["images"]
    assert sent[1] is None and sent[0].images == (picture,) and sent[0].tokens_per_image == (1,)
    assert sent[0].pixel_values is None and sent[0].prompt_positions is None
    assert [r.prompt_index for r in out] == [0, 0, 1, 1]


def test_a_vlm_presets_vllm_directory_has_what_vllms_processor_reads():
    """vLLM with a builtin VLM preset (`load_format = "dummy"`, weights from the trainer): the
    directory holds the nested config (transformers' image-text class), the preset's image
    processor and its byte tokenizer with the vision specials; `vlm_facts` reads the placeholders."""
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    from mrl.rollout.factory import engine_model_path
    from mrl.rollout.vision import vlm_facts

    d = engine_model_path(SimpleNamespace(load_format="dummy"), SimpleNamespace(path="builtin:tiny-qwen2.5-vl"))
    cfg = AutoConfig.from_pretrained(d)
    assert cfg.architectures == ["Qwen2_5_VLForConditionalGeneration"] and cfg.vision_config.spatial_merge_size == 2
    assert cfg.get_text_config().hidden_size == 128 and cfg.image_token_id == PAD
    assert AutoImageProcessor.from_pretrained(d).patch_size == 14
    assert AutoTokenizer.from_pretrained(d).convert_tokens_to_ids("<|image_pad|>") == PAD
    assert vlm_facts(d) == {"pad_id": PAD, "banned": [PAD, 262, START, END], "vocab_size": 512}
