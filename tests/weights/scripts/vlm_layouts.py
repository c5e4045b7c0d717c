"""Qwen2.5-VL / Qwen3-VL / multimodal Gemma 3 / multimodal Qwen3.5 HF checkpoints -> Megatron at TP=2 and PP=2 (one gloo launch, each
checkpoint and layout in turn).

Per layout: the exported stream equals the checkpoint bit for bit (vision tower included, read
from the first stage), and the logits of one packed row of image prompts, run through megatron's
pipeline schedule, equal the `transformers` logits the test saved (fp32, 1e-5). At TP=2 the tower
is then made trainable (`actor.vision.trainable`): its gradients are nonzero and equal on both
ranks, and megatron's `finalize_model_grads` averages them over the TP group (a gradient made to
differ on one rank comes back as the mean on both).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist


def packed_logits(chunks, ref: dict):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mrl.engine.packing import _thd_params

    row, pos, lens = ref["row"], ref["position_ids"], ref["lengths"]

    def step(data_iterator, model):
        out = model(row, pos, None, packed_seq_params=_thd_params(lens, "cpu"), pixel_values=ref["pixel_values"],
                    image_grid_thw=ref["image_grid_thw"])
        return out, lambda output, non_loss_data=False: output

    outs = get_forward_backward_func()(forward_step_func=step, data_iterator=iter([None]), model=chunks,
                                       num_microbatches=1, seq_length=row.shape[1], micro_batch_size=1,
                                       forward_only=True, collect_non_loss_data=True)
    return outs[0] if ps.is_pipeline_last_stage() else None


def check(d: Path, tp: int, pp: int) -> None:
    from safetensors.torch import load_file

    from mrl.models.megatron import complete_hf_config, gather_vocab_parallel_logits
    from mrl.models.roles import build_role_model
    from mrl.platform import setup, teardown
    from mrl.platform.config import ParallelConfig, PlatformConfig
    from mrl.weights import Exporter, load_hf_checkpoint

    parallel = ParallelConfig(tensor=tp, pipeline=pp, distributed_optimizer=False)
    setup(PlatformConfig(device="cpu", nodes=1, ranks_per_node=2, collective_timeout_s=120), parallel, seed=5)
    hf = complete_hf_config(json.loads((d / "config.json").read_text()))
    chunks = [build_role_model("actor", hf, parallel, dtype="float32", device="cpu").eval()]
    load_hf_checkpoint(chunks, d, hf)
    expected = load_file(d / "model.safetensors")
    if hf.get("tie_word_embeddings"):
        expected.pop("lm_head.weight", None)
    got = dict(Exporter(chunks, hf).stream("all"))
    assert set(got) == set(expected), set(got) ^ set(expected)
    for name, t in expected.items():
        assert torch.equal(got[name], t), f"{name} differs after round trip"
    tower = sum(n.startswith(("visual.", "model.visual.", "vision_tower.", "multi_modal_projector.")) for n in got)
    ref = torch.load(d / "reference.pt")
    with torch.no_grad():
        logits = packed_logits(chunks, ref)
    diff = torch.zeros((), dtype=torch.float64)
    if logits is not None:
        from mrl.models.vlm import PLACEHOLDER_FIELDS

        full = gather_vocab_parallel_logits(logits)[0, :, : hf["vocab_size"]]
        keep = torch.ones(hf["vocab_size"], dtype=torch.bool)
        keep[[hf[f] for f in PLACEHOLDER_FIELDS if hf.get(f) is not None]] = False   # banned by the policy: -1e9
        assert (full[:, ~keep] == -1e9).all()
        diff = (full[:, keep].double() - ref["logits"][:, keep].double()).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    grads = tower_grads_over_tp(chunks, ref, hf) if tp > 1 else tower_grads_over_pp(chunks, ref)
    if dist.get_rank() == 0:
        print(f"VLM {hf['model_type']} tp{tp} pp{pp} roundtrip ok {len(expected)} tensors ({tower} tower) logits {diff.item():.3e}{grads}",
              flush=True)
    teardown()


def tower_grads_over_tp(chunks, ref: dict, hf: dict) -> str:
    """Train the tower for one backward at TP=2; check its gradients as the docstring says."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from mrl.engine.packing import _thd_params
    from mrl.models.vlm_gpt import set_vision_trainable
    from mrl.optim.build import wrap_ddp

    set_vision_trainable(chunks, True)
    ddp = wrap_ddp(chunks, distributed_optimizer=False)
    ddp[0].zero_grad_buffer()
    out = ddp[0](ref["row"], ref["position_ids"], None, packed_seq_params=_thd_params(ref["lengths"], "cpu"),
                 pixel_values=ref["pixel_values"], image_grid_thw=ref["image_grid_thw"])
    (out[..., :200].float() ** 2).mean().backward()
    params = list(chunks[0].vision.named_parameters())
    flat = torch.cat([p.main_grad.flatten() for _, p in params])
    other = flat.clone()
    dist.broadcast(other, src=1, group=ps.get_tensor_model_parallel_group())
    assert torch.equal(flat, other), "tower gradients differ over TP"
    assert all(p.main_grad.abs().sum() > 0 for _, p in params), [n for n, p in params if p.main_grad.abs().sum() == 0]
    name, probe = params[0]
    before = probe.main_grad.clone()
    if ps.get_tensor_model_parallel_rank() == 1:
        probe.main_grad.add_(2.0)
    finalize_model_grads(ddp)
    assert torch.allclose(probe.main_grad, before + 1.0, atol=1e-6), f"{name}: not averaged over TP"
    set_vision_trainable(chunks, False)
    return f" tower grads {len(params)} equal over tp, averaged"


def tower_grads_over_pp(chunks, ref: dict) -> str:
    """At PP=2, tower trainable: one forward/backward through megatron's pipeline schedule reaches
    every tower tensor on the first stage (Qwen3-VL's deepstack layers there too)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mrl.engine.packing import _thd_params
    from mrl.models.vlm_gpt import set_vision_trainable
    from mrl.optim.build import wrap_ddp

    set_vision_trainable(chunks, True)
    ddp = wrap_ddp(chunks, distributed_optimizer=False)
    ddp[0].zero_grad_buffer()
    row, pos, lens = ref["row"], ref["position_ids"], ref["lengths"]

    def step(data_iterator, model):
        out = model(row, pos, None, packed_seq_params=_thd_params(lens, "cpu"), pixel_values=ref["pixel_values"],
                    image_grid_thw=ref["image_grid_thw"])
        return out, lambda output: ((output[..., :200].float() ** 2).mean(), {})

    get_forward_backward_func()(forward_step_func=step, data_iterator=iter([None]), model=ddp, num_microbatches=1,
                                seq_length=row.shape[1], micro_batch_size=1, forward_only=False)
    n = torch.zeros((), dtype=torch.long)
    if ps.is_pipeline_first_stage():
        params = list(chunks[0].vision.parameters())
        assert all(p.main_grad.abs().sum() > 0 for p in params), "a tower tensor got no gradient at PP=2"
        n += len(params)
    dist.all_reduce(n)
    set_vision_trainable(chunks, False)
    return f" tower grads {int(n)} through the pipeline"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True, action="append")
    a = ap.parse_args()
    for d in a.dir:
        for tp, pp in ((2, 1), (1, 2)):
            check(Path(d), tp, pp)


if __name__ == "__main__":
    main()
