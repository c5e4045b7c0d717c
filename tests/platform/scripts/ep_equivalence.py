"""MoE EP=2 vs EP=1 on the cpu platform (alltoall token dispatcher): same logits and gradients.

Each rank feeds its own batch, so at EP=2 tokens really cross ranks (uneven all-to-all splits).
Logits, loss and non-expert gradients are per-rank; an expert's EP=2 gradient collects the
tokens of both ranks, so it is compared with the EP=1 gradient summed over ranks.
"""
import re

import torch
import torch.distributed as dist

import _common as C
from mrl.models import tiny_model as tm

SPEC = tm.TinyGPTSpec(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=48, vocab_size=96, seq_length=8, num_moe_experts=4, moe_router_topk=2)
B = 3
EXPERT = re.compile(r"(.*\.local_experts\.)(\d+)(\..*)")


def batch(rank):
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, SPEC.vocab_size, (B, SPEC.seq_length), generator=g)
    labels = torch.randint(0, SPEC.vocab_size, (B, SPEC.seq_length), generator=g)
    return ids, tm.position_ids(B, SPEC.seq_length), None, labels


def run(model, rank):
    ids, pos, mask, labels = batch(rank)
    logits = model(ids, pos, mask).detach()
    loss = model(ids, pos, mask, labels=labels)
    loss.mean().backward()
    return logits, loss.detach()


def main():
    # Load-balancing aux loss on, so megatron's aux-loss tracker (device="cuda" buffers) runs.
    tm_overrides = dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2)
    ctx = C.up(expert=1)
    rank = ctx.rank
    torch.manual_seed(31)
    ref = tm.build_tiny_gpt(SPEC, config=tm.tiny_gpt_config(SPEC, **tm_overrides))
    C.perturb_(ref, seed=32)
    logits1, loss1 = run(ref, rank)
    params1, grads1 = C.full_params(ref), C.full_grads(ref)
    summed = {}
    for name in sorted(grads1):
        if EXPERT.match(name):
            g = grads1[name].clone()
            dist.all_reduce(g)
            summed[name] = g
    assert summed, "the MoE model has expert parameters"
    C.down()

    ctx = C.up(expert=2)
    assert ctx.layout.ep == 2
    ep_rank, per_rank = ctx.layout.ep_rank, SPEC.num_moe_experts // 2

    def global_name(name):
        m = EXPERT.match(name)
        return f"{m.group(1)}{int(m.group(2)) + ep_rank * per_rank}{m.group(3)}" if m else name

    model = tm.build_tiny_gpt(SPEC, config=tm.tiny_gpt_config(SPEC, **tm_overrides))
    local = [n for n, _ in model.named_parameters()]
    assert sum(1 for n in local if EXPERT.match(n)) * 2 == len(summed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params1[global_name(name)])
    logits2, loss2 = run(model, rank)
    C.report("ep_logits", C.check("logits", logits2, logits1))
    C.report("ep_loss", C.check("per-token loss", loss2, loss1))
    worst = 0.0
    for name, p in model.named_parameters():
        gname = global_name(name)
        want = summed[gname] if EXPERT.match(name) else grads1[gname]
        worst = max(worst, C.check(f"grad {gname}", p.grad, want))
    C.report("ep_grads", worst)
    C.down()


if __name__ == "__main__":
    C.main_guard(main)
