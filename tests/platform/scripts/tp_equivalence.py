"""TP=2 vs TP=1 on the cpu platform: same weights -> same logits, loss and gradients (<= 1e-5).

The TP=1 model is built and perturbed from a seed on every rank; its full weights are sliced
into TP=2 shards by megatron's layouts (`_common.shard`), the TP=2 logits are gathered over the
vocab-parallel output, and TP=2 gradients are compared with slices of the TP=1 gradients.
"""
import torch

import _common as C
from mrl.models import tiny_model as tm

SPEC = tm.TinyGPTSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=96, vocab_size=128, seq_length=16)
B = 3


def batch():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, SPEC.vocab_size, (B, SPEC.seq_length), generator=g)
    labels = torch.randint(0, SPEC.vocab_size, (B, SPEC.seq_length), generator=g)
    return ids, tm.position_ids(B, SPEC.seq_length), None, labels


def run(model, gather):
    ids, pos, mask, labels = batch()
    logits = model(ids, pos, mask)
    logits = gather(logits) if gather else logits
    loss = model(ids, pos, mask, labels=labels)          # per-token loss [B, S] (vocab-parallel CE)
    loss.mean().backward()
    return logits.detach(), loss.detach()


def main():
    ctx = C.up(tensor=1)
    assert ctx.layout.tp == 1 and ctx.dp == 2
    torch.manual_seed(11)
    ref = tm.build_tiny_gpt(SPEC)
    C.perturb_(ref, seed=12)
    logits1, loss1 = run(ref, gather=None)
    params1, grads1 = C.full_params(ref), C.full_grads(ref)
    assert len(grads1) == len(params1)
    C.down()

    ctx = C.up(tensor=2)
    assert ctx.layout.tp == 2 and ctx.dp == 1
    torch.manual_seed(99)  # different init: every weight must come from the copy
    model = tm.build_tiny_gpt(SPEC)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(names) == sorted(params1), (names, list(params1))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(C.shard(name, params1[name], 2, ctx.layout.tp_rank, num_query_groups=SPEC.num_query_groups))
    logits2, loss2 = run(model, gather=tm.gather_vocab_parallel_logits)
    C.report("tp_logits", C.check("logits", logits2, logits1))
    C.report("tp_loss", C.check("per-token loss", loss2, loss1))
    worst = 0.0
    for name, p in model.named_parameters():
        want = C.shard(name, grads1[name], 2, ctx.layout.tp_rank, num_query_groups=SPEC.num_query_groups)
        worst = max(worst, C.check(f"grad {name}", p.grad, want))
    C.report("tp_grads", worst)
    # Sanity: the comparison is not vacuous.
    assert logits1.abs().max() > 0.1 and max(g.abs().max().item() for g in grads1.values()) > 1e-3

    # Activation recompute with dropout: the recomputed forward must replay the same dropout masks
    # (megatron restores the "CUDA" RNG states, on cpu the CPU generator) and give the same grads.
    no_dropout = {n: p.grad for n, p in model.named_parameters()}
    C.report("tp_recompute_grads", recompute_matches(params1, ctx.layout.tp_rank, no_dropout))

    # tensor_parallel.broadcast_data: TP rank 0's batch reaches every TP rank.
    from megatron.core import tensor_parallel

    ids = batch()[0]
    got = tensor_parallel.broadcast_data(["ids"], {"ids": ids} if ctx.layout.tp_rank == 0 else None, torch.int64)
    assert torch.equal(got["ids"], ids)
    C.down()


def recompute_matches(params1, tp_rank, no_dropout):
    from mrl.platform.parallel import seed_model_parallel

    grads = []
    for recompute in (False, True):
        extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                     distribute_saved_activations=True) if recompute else {}
        cfg = tm.tiny_gpt_config(SPEC, hidden_dropout=0.2, attention_dropout=0.2, **extra)
        # megatron's own attention: mrl's packed backends refuse attention dropout (RL runs without it)
        model = tm.build_tiny_gpt(SPEC, config=cfg, attention="reference")
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(C.shard(name, params1[name], 2, tp_rank, num_query_groups=SPEC.num_query_groups))
        seed_model_parallel(77, "cpu")
        ids, pos, mask, labels = batch()
        model(ids, pos, mask, labels=labels).mean().backward()
        grads.append(C.full_grads(model))
    worst = 0.0
    for name, g in grads[0].items():
        worst = max(worst, C.check(f"recompute grad {name}", grads[1][name], g))
    # Dropout was active: the grads differ from the dropout-free run.
    assert max((grads[0][n] - g).abs().max().item() for n, g in no_dropout.items()) > 1e-3
    return worst


if __name__ == "__main__":
    C.main_guard(main)
