"""HF checkpoint -> Megatron (this layout) -> HF, under torchrun (gloo).

Checks, on every rank: the exported stream equals the checkpoint bit for bit (targets "all"
and targets 0); the Megatron logits (gathered over TP, from the last pipeline stage) match the
`transformers` logits saved by the test; the actor's log-probs through the fused-kernel path
match log_softmax(...).gather. Rank 0 writes the exported tensors for a from_pretrained check.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist


def forward_logits(chunks, tokens: torch.Tensor):
    """Vocab-parallel logits [B, S, V_pad/tp] through megatron's schedule; None off the last stage."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mrl.models.megatron import position_ids

    b, s = tokens.shape

    def step(data_iterator, model):
        out = model(tokens, position_ids(b, s), None)
        return out, lambda output, non_loss_data=False: output

    outs = get_forward_backward_func()(forward_step_func=step, data_iterator=iter([None]), model=chunks,
                                       num_microbatches=1, seq_length=s, micro_batch_size=b,
                                       forward_only=True, collect_non_loss_data=True)
    return outs[0] if ps.is_pipeline_last_stage() else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True, nargs="+", help="one or more saved HF models, checked in turn")
    ap.add_argument("--layouts", nargs="+", default=["tp1"],
                    help="each e.g. tp2, pp2, ep2, dp2 (the rest of the world is data parallel)")
    ap.add_argument("--out", default=None, help="rank 0 writes each model's first-layout export to <out>/<dir name>")
    ap.add_argument("--moe-layouts", nargs="*", default=[], help="layouts (ep2) run only for MoE models")
    a = ap.parse_args()
    for d in map(Path, a.dir):
        moe = any(k in json.loads((d / "config.json").read_text())
                  for k in ("num_experts", "num_local_experts", "n_routed_experts"))
        for i, layout in enumerate(a.layouts + (a.moe_layouts if moe else [])):
            sizes = {"tp": 1, "pp": 1, "ep": 1, "dp": 1}
            sizes[layout[:2]] = int(layout[2:])
            out = Path(a.out) / d.name if a.out and i == 0 else None
            if out is not None and dist_rank() == 0:
                out.mkdir(parents=True, exist_ok=True)
            check_layout(d, sizes, out)


def dist_rank() -> int:
    import os

    return int(os.environ.get("RANK", "0"))


def check_layout(d: Path, sizes: dict, out) -> None:
    from safetensors.torch import load_file, save_file

    from mrl.models.megatron import complete_hf_config, gather_vocab_parallel_logits
    from mrl.models.roles import build_role_model, token_logprobs
    from mrl.platform import setup, teardown
    from mrl.platform.config import ParallelConfig, PlatformConfig
    from mrl.weights import Exporter, load_hf_checkpoint
    from megatron.core import parallel_state as ps

    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    # gpt-oss' biased experts are built unsplit (expert_tensor 1) at any TP
    etp = 1 if json.loads((d / "config.json").read_text())["model_type"] == "gpt_oss" else None
    parallel = ParallelConfig(tensor=sizes["tp"], pipeline=sizes["pp"], expert=sizes["ep"], expert_tensor=etp,
                              distributed_optimizer=False)
    setup(PlatformConfig(device="cpu", nodes=1, ranks_per_node=world, collective_timeout_s=120), parallel, seed=5)
    hf = complete_hf_config(json.loads((d / "config.json").read_text()))
    chunks = [build_role_model("actor", hf, parallel, dtype="float32", device="cpu")]
    report = load_hf_checkpoint(chunks, d, hf)
    assert report.tensors_read > 0

    expected = load_file(d / "model.safetensors")
    if hf.get("tie_word_embeddings"):
        expected.pop("lm_head.weight", None)
    from mrl.weights.stacked import stack_experts

    exporter = Exporter(chunks, hf)
    for targets in ("all", 0):
        got = dict(stack_experts(exporter.stream(targets), hf))   # gpt-oss: its stacked expert tensors
        if targets == "all" or dist.get_rank() == 0:
            assert list(got) == sorted(got, key=list(got).index)  # streamed once each
            assert set(got) == set(expected), (set(got) ^ set(expected))
            for name, t in expected.items():
                assert got[name].dtype == t.dtype and torch.equal(got[name], t), f"{name} differs after round trip"
        else:
            assert not got, f"rank {dist.get_rank()} materialised {len(got)} tensors under targets=0"
    if dist.get_rank() == 0:
        print(f"ROUNDTRIP {d.name} {sizes} ok {len(expected)} tensors", flush=True)
        if out:
            save_file({k: v.contiguous() for k, v in got.items()}, Path(out) / "model.safetensors",
                      metadata={"format": "pt"})

    ref = torch.load(d / "reference.pt")
    tokens = ref["tokens"]
    for c in chunks:
        c.eval()  # inference: megatron refuses MoE + TP without sequence parallelism only in training
    logits_vp = forward_logits(chunks, tokens)
    diff = torch.zeros((), dtype=torch.float64)
    lp_diff = torch.zeros((), dtype=torch.float64)
    if logits_vp is not None:
        full = gather_vocab_parallel_logits(logits_vp)[..., : hf["vocab_size"]]
        diff = (full.double() - ref["logits"].double()).abs().max()
        labels = tokens[:, 1:]
        lp, ent = token_logprobs(logits_vp[:, :-1], labels, vocab_size=hf["vocab_size"],
                                 tp_group=ps.get_tensor_model_parallel_group() if sizes["tp"] > 1 else None)
        lp_diff = (lp.double() - ref["logprobs"].double()).abs().max()
        lp_diff = torch.maximum(lp_diff, (ent.double() - ref["entropy"].double()).abs().max())
    for t in (diff, lp_diff):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print(f"MAXDIFF {d.name} {sizes} logits {diff.item():.3e}", flush=True)
        print(f"MAXDIFF {d.name} {sizes} logprobs {lp_diff.item():.3e}", flush=True)
    assert diff.item() <= 1e-5 and lp_diff.item() <= 1e-5, (diff.item(), lp_diff.item())
    if "norm_grads" in ref and sizes["pp"] == 1:
        check_norm_grads(chunks[0], tokens, ref["norm_grads"], hf, sizes)
    teardown()


def check_norm_grads(model, tokens, want: dict, hf: dict, sizes: dict) -> None:
    """Gated DeltaNet hybrids: the gradient of the summed log-probs on each layer's gated output norm
    (a weight every TP rank holds, applied to its own heads) equals transformers' at this layout."""
    from megatron.core import parallel_state as ps

    from mrl.models.megatron import position_ids
    from mrl.models.roles import token_logprobs

    model.zero_grad(set_to_none=True)
    logits = model(tokens, position_ids(*tokens.shape), None)
    lp, _ = token_logprobs(logits[:, :-1], tokens[:, 1:], vocab_size=hf["vocab_size"],
                           tp_group=ps.get_tensor_model_parallel_group() if sizes["tp"] > 1 else None)
    lp.sum().backward()
    worst = 0.0
    for name, p in model.named_parameters():
        if name.endswith("self_attention.out_norm.weight"):
            layer = int(name.split(".")[2])
            worst = max(worst, (p.grad - want[f"model.layers.{layer}.linear_attn.norm.weight"]).abs().max().item())
    if dist.get_rank() == 0:
        print(f"NORMGRAD {sizes} {worst:.3e}", flush=True)
    assert worst <= 1e-4, worst


if __name__ == "__main__":
    main()
