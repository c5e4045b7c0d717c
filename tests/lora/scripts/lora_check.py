"""LoRA on a tiny Qwen2 (from a Hugging Face directory) at this launch's TP size.

`python lora_check.py HF_DIR OUT [--tensor N]` (under torchrun for N > 1). Checks in place and
writes `OUT/tp<N>.pt` (rank 0) for the cross-layout comparison:
- adapters with B = 0 give the base model's logits exactly;
- after a backward pass only adapter parameters hold gradients;
- with B set (the same full values at every TP size) the adapted logits, and the gathered
  adapter gradients, are saved;
- the merged export (`Exporter`: W + scale B A) loaded into `transformers` gives the adapted
  Megatron logits (fp32, <= 1e-5);
- the adapters written as a PEFT adapter directory (`write_adapter`: gathered over TP like the
  full export, q/k/v and gate/up per projection) and loaded by `peft` over the HF base give the
  adapted Megatron logits (fp32, <= 1e-5);
- the reference engine (the actor's modules, adapters off) gives the log-probs of a separately
  built base model.
"""
import argparse
import json
import types

import torch


def full_value(name: str, shape, seed: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + sum(map(ord, name)))
    return torch.randn(shape, generator=g) * 0.05


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir")
    ap.add_argument("out")
    ap.add_argument("--tensor", type=int, default=1)
    args = ap.parse_args()

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mrl.batch import Batch
    from mrl.engine import Engine
    from mrl.engine.objectives import actor_outputs
    from mrl.models.config import ModelConfig
    from mrl.engine.reference import reference_engine
    from mrl.models.lora import LoraConfig, adapters_disabled, apply_lora, lora_linears
    from mrl.models.megatron import gather_vocab_parallel_logits, hf_config, position_ids
    from mrl.models.roles import build_role_model, freeze
    from mrl.platform import setup, teardown
    from mrl.platform.config import ParallelConfig, PlatformConfig
    from mrl.weights import Exporter, load_hf_checkpoint

    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    par = ParallelConfig(tensor=args.tensor, distributed_optimizer=False)
    ctx = setup(PlatformConfig(device="cpu", ranks_per_node=world), par, seed=3)
    hf = hf_config(ModelConfig(path=args.hf_dir))
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()

    def model():
        m = build_role_model("actor", hf, par, dtype="float32", device="cpu")
        load_hf_checkpoint([m], args.hf_dir, hf, role="actor")
        return m

    actor = apply_lora(model(), LoraConfig(rank=4, alpha=8.0), seed=11)
    if tp == 1:   # tools/bench/lora.py's arithmetic against the built model
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools" / "bench"))
        from lora import count_parameters
        from mrl.models.lora import HF_TARGETS
        from mrl.models.megatron import padded_vocab_size

        counted = count_parameters({**hf, "vocab_size": padded_vocab_size(hf["vocab_size"], 1)}, rank=4,
                                   targets=HF_TARGETS)
        built = {"total": sum(p.numel() for n, p in actor.named_parameters() if ".lora." not in n),
                 "lora": sum(p.numel() for p in actor.parameters() if p.requires_grad)}
        assert counted == built, (counted, built)
    tokens = torch.randint(0, hf["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    pos = position_ids(2, 12)

    def logits(m):
        return gather_vocab_parallel_logits(m(tokens, pos, None))[..., :hf["vocab_size"]]

    with torch.no_grad():
        fresh = logits(actor)
        with adapters_disabled([actor]):
            base = logits(actor)
    assert torch.equal(fresh, base), (fresh - base).abs().max()

    # B (and A) set to layout-independent values: the full tensor, this rank's slice
    with torch.no_grad():
        for lname, lin in lora_linears(actor):
            layer = lname.split(".")[2]
            for kind in ("A", "B"):
                for t, p in getattr(lin.lora, kind).items():
                    if getattr(p, "tensor_model_parallel", False) and tp > 1:
                        dim = p.partition_dim
                        full_shape = list(p.shape)
                        full_shape[dim] *= tp
                        full = full_value(f"{layer}.{t}.{kind}", full_shape)
                        p.copy_(full.narrow(dim, tp_rank * p.shape[dim], p.shape[dim]))
                    else:
                        p.copy_(full_value(f"{layer}.{t}.{kind}", p.shape))
    adapted = logits(actor)
    loss = torch.nn.functional.cross_entropy(adapted[:, :-1].reshape(-1, adapted.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    with_grad = {n for n, p in actor.named_parameters() if p.grad is not None}
    adapters = {n for n, p in actor.named_parameters() if ".lora." in n}
    assert with_grad == adapters, sorted(with_grad ^ adapters)[:5]
    assert all(not p.requires_grad for n, p in actor.named_parameters() if ".lora." not in n)
    grads = {}
    for n, p in actor.named_parameters():
        if ".lora." not in n:
            continue
        g = p.grad.contiguous()
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(parts, g, group=ps.get_tensor_model_parallel_group())
            g = torch.cat(parts, dim=p.partition_dim)
        grads[n] = g

    # merged export -> transformers
    weights = dict(Exporter([actor], hf).stream())
    report = {"loss": float(loss.detach())}
    if ctx.rank == 0:
        from transformers import AutoConfig, AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.hf_dir), dtype=torch.float32)
        missing, unexpected = hf_model.load_state_dict(weights, strict=False)
        assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
        hf_model.tie_weights()
        with torch.no_grad():
            ref_logits = hf_model.eval()(tokens).logits
        report["merged_vs_megatron"] = float((ref_logits - adapted.detach()).abs().max())
        report["adapted_vs_base"] = float((adapted.detach() - base).abs().max())

    # the adapters as a PEFT directory -> peft over the HF base
    from mrl.merge.peft import peft_logits, write_adapter

    lora_cfg = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": list(LoraConfig().target_modules)}
    peft_dir = f"{args.out}/peft_tp{tp}"
    n = write_adapter([actor], hf, lora_cfg, peft_dir, base=args.hf_dir)
    if ctx.rank == 0:
        assert n == 28, n   # 2 layers x 7 projections x (A, B)
        report["peft_vs_megatron"] = float((peft_logits(peft_dir, args.hf_dir, tokens) - adapted.detach()).abs().max())

    # reference engine = the actor with adapters off = a separately built, frozen base model
    lengths = [(5, 4), (3, 7), (6, 2)]
    g = torch.Generator().manual_seed(1)
    batch = Batch.from_sequences([torch.randint(0, 250, (p,), generator=g).tolist() for p, _ in lengths],
                                 [torch.randint(0, 250, (r,), generator=g).tolist() for _, r in lengths])
    out = actor_outputs(vocab_size=hf["vocab_size"])
    ref = reference_engine(types.SimpleNamespace(chunks=[actor])).forward_only(batch, out, micro_batch_tokens=16)
    plain = Engine([freeze(model())], name="base").forward_only(batch, out, micro_batch_tokens=16)
    report["ref_vs_base_logprobs"] = float((ref["logprobs"] - plain["logprobs"]).abs().max())
    on = Engine([actor], name="actor").forward_only(batch, out, micro_batch_tokens=16)
    report["actor_vs_base_logprobs"] = float((on["logprobs"] - plain["logprobs"]).abs().max())
    if ctx.rank == 0:
        torch.save({"logits": adapted.detach(), "grads": grads, "loss": float(loss.detach())}, f"{args.out}/tp{tp}.pt")
        print("RESULT " + json.dumps(report), flush=True)
    teardown()


if __name__ == "__main__":
    main()
