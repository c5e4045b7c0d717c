"""`actor.vision.trainable`: the vision tower trains with the language model (gradients, optimizer
state, checkpoint and exact resume, the weight stream the rollout engine loads) or stays frozen
(the default), on the tiny Qwen3-VL (deepstack included), fp32 and bf16, one rank in-process."""
from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from tests.weights.vlm_archs import image_prompt_inputs, make_vlm, one_rank_platform


platform = pytest.fixture(scope="module")(one_rank_platform)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_vl")
    make_vlm(d, preset="tiny-qwen3-vl")
    return d


def _batch(hf):
    """Two image prompts (1 and 2 images) with 2 fixed responses each: a `Batch` whose prompt items
    carry their images as the trainer's do."""
    from mrl.batch import Batch
    from mrl.models.vlm import mrope_position_ids

    prompts, inputs = image_prompt_inputs(hf)
    items = [SimpleNamespace(images=replace(x, prompt_positions=mrope_position_ids(
        hf, torch.tensor([p]), x.image_grid_thw)[:, 0])) for p, x in zip(prompts, inputs)]
    g = torch.Generator().manual_seed(7)
    responses = [torch.randint(0, 256, (5,), generator=g).tolist() for _ in range(4)]
    batch = Batch.from_sequences([prompts[i // 2] for i in range(4)], responses, pad_id=256)
    return Batch(batch.tensors, {"prompt_item": [items[i // 2] for i in range(4)]})


def _nll(vocab):
    """Mean negative log-likelihood of the response tokens (a loss whose gradient reaches every weight)."""
    from mrl.engine.objectives import response_logprobs

    def loss(logits, mb, totals):
        logp, _ = response_logprobs(logits, mb, entropy=False, vocab_size=vocab)
        return -logp.sum() / totals.tokens, {}
    return loss


def _engine(d, dtype, trainable):
    from mrl.engine.engine import Engine
    from mrl.models.megatron import complete_hf_config
    from mrl.models.roles import build_role_model
    from mrl.models.vlm_gpt import set_vision_trainable
    from mrl.optim.build import build_optimizer, build_scheduler, wrap_ddp
    from mrl.optim.config import OptimConfig, ScheduleConfig
    from mrl.platform.config import ParallelConfig
    from mrl.weights import load_hf_checkpoint

    hf = complete_hf_config(json.loads((d / "config.json").read_text()))
    model = build_role_model("actor", hf, ParallelConfig(), dtype=dtype, device="cpu")
    load_hf_checkpoint([model], d, hf)
    assert set_vision_trainable([model], trainable) == (sum(p.numel() for p in model.vision.parameters())
                                                        if trainable else 0)
    ddp = wrap_ddp([model], distributed_optimizer=False)
    optim = OptimConfig(lr=1e-2, weight_decay=0.0)
    opt = build_optimizer(ddp, optim, distributed_optimizer=False)
    sched = build_scheduler(opt, optim, ScheduleConfig(), 10)
    return hf, model, Engine(ddp, optimizer=opt, scheduler=sched, name="actor")


def _tower(model):
    return {n: p.detach().clone() for n, p in model.vision.named_parameters()}


def _text(model):
    return model.decoder.layers[0].self_attention.linear_qkv.weight.detach().clone()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tower_trains_when_trainable_only_and_resumes_exactly(platform, checkpoint, tmp_path, dtype):
    from mrl.checkpoint import state
    from mrl.weights import Exporter

    # frozen (the default): the language model moves, the tower does not, the optimizer holds none of it
    hf, model, eng = _engine(checkpoint, dtype, trainable=False)
    batch, loss = _batch(hf), _nll(hf["vocab_size"])
    before, text = _tower(model), _text(model)
    eng.train_mini_batch(batch, loss, micro_batch_tokens=10_000)
    assert all(torch.equal(p, before[n]) for n, p in model.vision.named_parameters())
    assert not torch.equal(_text(model), text)
    held = {id(p) for group in eng.optimizer.param_groups for p in group["params"]}
    assert not any(id(p) in held for p in model.vision.parameters())

    # trainable: every tower tensor that feeds the language model moves (the deepstack mergers too)
    hf, model, eng = _engine(checkpoint, dtype, trainable=True)
    before = _tower(model)
    m1 = eng.train_mini_batch(batch, loss, micro_batch_tokens=10_000)
    moved = {n for n, p in model.vision.named_parameters() if not torch.equal(p, before[n])}
    assert moved == set(before), sorted(set(before) - moved)
    assert any(n.startswith("deepstack_merger_list.1.") for n in moved)
    assert torch.isfinite(torch.tensor(m1["grad_norm"])) and m1["updated"] == 1.0
    # the weight stream carries the trained tower under its checkpoint names, and the hf rollout
    # engine loads it (a full sync: every engine parameter filled) into its own tower
    from mrl.rollout.hf import HFEngine

    stream = dict(Exporter([model], hf).stream())
    for n, p in model.vision.named_parameters():
        assert torch.equal(stream[f"model.visual.{n}"], p.detach())
    engine = HFEngine.from_config(hf, dtype=dtype)
    assert engine.update_weights(iter(stream.items())) == len(stream)
    for n, p in engine.model.model.visual.named_parameters():
        assert torch.equal(p, stream[f"model.visual.{n}"]), n

    # exact resume: step 2 after a save/load into a fresh engine equals step 2 in one go
    state.save(tmp_path / "ck", 1, chunks=eng.chunks, optimizer=eng.optimizer, scheduler=eng.scheduler)
    m2 = eng.train_mini_batch(batch, loss, micro_batch_tokens=10_000)
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    _, again, eng2 = _engine(checkpoint, dtype, trainable=True)
    state.load(tmp_path / "ck", chunks=eng2.chunks, optimizer=eng2.optimizer, scheduler=eng2.scheduler)
    r2 = eng2.train_mini_batch(batch, loss, micro_batch_tokens=10_000)
    assert r2["loss"] == m2["loss"] and r2["grad_norm"] == m2["grad_norm"]
    for n, p in again.named_parameters():
        assert torch.equal(p.detach(), after[n]), n
    print(f"TOWER {dtype} step-1 loss {m1['loss']:.6f} step-2 loss {m2['loss']:.6f} "
          f"max tower change {max((p - before[n]).abs().max().item() for n, p in model.vision.named_parameters()):.3e}")


def test_trainable_tower_refusals(capsys):
    from mrl.models.config import ModelConfig
    from mrl.models.megatron import hf_config
    from mrl.models.vlm import trainable_tower_problem

    q3 = hf_config(ModelConfig(path="builtin:tiny-qwen3-vl"))
    q25 = hf_config(ModelConfig(path="builtin:tiny-qwen2.5-vl"))
    assert trainable_tower_problem(q3, lora_rank=0, recompute="selective", key="actor") is None
    assert trainable_tower_problem(q25, lora_rank=0, recompute="full", key="actor") is None
    assert "recompute = 'full' for qwen3_vl" in trainable_tower_problem(q3, lora_rank=0, recompute="full", key="actor")
    assert "with actor.lora" in trainable_tower_problem(q25, lora_rank=8, recompute="none", key="actor")
    assert trainable_tower_problem(hf_config(ModelConfig(path="builtin:tiny-qwen2")), lora_rank=0, recompute="none",
                                   key="actor") == "actor.vision.trainable: model_type 'qwen2' has no vision tower"
    # mrl validate reports it under the key, as mrl train refuses it
    from mrl.cli import main

    capsys.readouterr()
    assert main(["validate", "jobs/quickstart_cpu.toml", "actor.vision.trainable=true"]) == 2
    assert "actor.vision.trainable: model_type 'qwen2' has no vision tower" in capsys.readouterr().err
    assert main(["validate", "jobs/quickstart_vlm_cpu.toml", "actor.vision.trainable=true"]) == 0


def test_full_recompute_keeps_deepstack_gradients_of_a_frozen_tower(platform, checkpoint):
    """With the tower frozen the deepstack features are constants, so full recomputation (whose
    recomputed layers run without them) gives the language model the gradients of no recomputation
    (why only the trainable tower is refused with it)."""
    from mrl.engine.packing import _thd_params
    from mrl.models.megatron import complete_hf_config
    from mrl.models.roles import build_role_model
    from mrl.optim.build import wrap_ddp
    from mrl.platform.config import ParallelConfig
    from mrl.weights import load_hf_checkpoint
    from tests.weights.test_vlm import save_checkpoint

    d = save_checkpoint(checkpoint / "ref", "tiny-qwen3-vl") if not (checkpoint / "ref").exists() else checkpoint / "ref"
    ref = torch.load(d / "reference.pt")
    grads = {}
    for recompute in ("none", "full"):
        hf = complete_hf_config(json.loads((d / "config.json").read_text()))
        model = build_role_model("actor", hf, ParallelConfig(), dtype="float32", device="cpu", recompute=recompute)
        load_hf_checkpoint([model], d, hf)
        ddp = wrap_ddp([model], distributed_optimizer=False)
        ddp[0].zero_grad_buffer()
        out = ddp[0](ref["row"], ref["position_ids"], None, packed_seq_params=_thd_params(ref["lengths"], "cpu"),
                     pixel_values=ref["pixel_values"], image_grid_thw=ref["image_grid_thw"])
        (out[..., :200].float() ** 2).mean().backward()
        grads[recompute] = {n: p.main_grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads["none"].keys() == grads["full"].keys()
    for n, g in grads["none"].items():
        assert torch.allclose(grads["full"][n], g, atol=1e-6, rtol=1e-5), n
    assert grads["none"]["decoder.layers.0.self_attention.linear_qkv.weight"].abs().sum() > 0
