"""PP=2 vs PP=1 on the cpu platform with megatron's pipeline schedule: same loss and gradients.

Both layouts run `get_forward_backward_func()` over the same micro-batches (PP=1: the
no-pipelining schedule; PP=2: 1F1B with gloo point-to-point). Stage-local layer names are
mapped to global layer indices before comparing with the PP=1 gradients.
"""
import re

import torch

import _common as C
from mrl.models import tiny_model as tm

SPEC = tm.TinyGPTSpec(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=64, vocab_size=96, seq_length=8)
MBS, N_MICRO = 2, 3


def microbatches():
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(N_MICRO):
        ids = torch.randint(0, SPEC.vocab_size, (MBS, SPEC.seq_length), generator=g)
        labels = torch.randint(0, SPEC.vocab_size, (MBS, SPEC.seq_length), generator=g)
        out.append(dict(ids=ids, labels=labels, pos=tm.position_ids(MBS, SPEC.seq_length),
                        mask=None))
    return out


def forward_step(data_iterator, model):
    mb = next(data_iterator)
    out = model(mb["ids"], mb["pos"], mb["mask"], labels=mb["labels"])

    def loss_func(per_token):
        loss = per_token.float().mean()
        return loss, {"loss": loss.detach()}

    return out, loss_func


def train_step(model):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    fb = get_forward_backward_func()
    losses = fb(forward_step_func=forward_step, data_iterator=iter(microbatches()), model=[model],
                num_microbatches=N_MICRO, seq_length=SPEC.seq_length, micro_batch_size=MBS, forward_only=False)
    return torch.stack([d["loss"] for d in losses]) if losses else None


def global_name(name: str, pp_rank: int, pp: int) -> str:
    per_stage = SPEC.num_layers // pp
    return re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + pp_rank * per_stage}.", name)


def main():
    import torch.distributed as dist

    ctx = C.up(pipeline=1)
    torch.manual_seed(21)
    ref = tm.build_tiny_gpt(SPEC)
    C.perturb_(ref, seed=22)
    losses1 = train_step(ref)
    params1, grads1 = C.full_params(ref), C.full_grads(ref)
    C.down()

    ctx = C.up(pipeline=2)
    assert ctx.layout.pp == 2
    pp_rank = ctx.layout.pp_rank
    model = tm.build_tiny_gpt(SPEC)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params1[global_name(name, pp_rank, 2)])
    losses2 = train_step(model)
    # Only the last stage sees the loss; share it so both ranks check.
    buf = losses2 if losses2 is not None else torch.zeros(N_MICRO)
    dist.broadcast(buf, src=1)
    C.report("pp_loss", C.check("micro-batch losses", buf, losses1))
    worst, seen = 0.0, set()
    for name, p in model.named_parameters():
        gname = global_name(name, pp_rank, 2)
        seen.add(gname)
        worst = max(worst, C.check(f"grad {gname}", p.grad, grads1[gname]))
    names = [None, None]
    dist.all_gather_object(names, sorted(seen))
    assert set(names[0]) | set(names[1]) == set(grads1), "PP stages must cover every parameter"
    assert not set(names[0]) & set(names[1])
    C.report("pp_grads", worst)

    # Tied embeddings across stages: megatron all-reduces the first stage's embedding into the
    # last stage's (zero-initialized) output weight at construction.
    tied = tm.build_tiny_gpt(SPEC, share_embeddings=True)
    w = tied.shared_embedding_or_output_weight().detach().contiguous()
    both = [torch.empty_like(w), torch.empty_like(w)]
    dist.all_gather(both, w)
    assert both[0].abs().max() > 0
    C.report("pp_tied_embedding", C.check("tied embedding first vs last stage", both[1], both[0], tol=0.0))
    C.down()


if __name__ == "__main__":
    C.main_guard(main)
