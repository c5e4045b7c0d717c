"""Checkpoint at TP=2, load at another layout: the next step equals continuing without the checkpoint.

Usage: ckpt_resume.py DIR plain|distributed. `plain` (megatron's fp32 optimizer) loads at
TP=1 x DP=2; `distributed` (the distributed optimizer) loads at TP=2 x DP=1 into a fresh process
group and model. Model, optimizer state (Adam moments), scheduler, step and `extra` must all
round-trip; the next update's loss, grad norm, learning rate and weights are compared."""
import sys

import torch

import _engine_common as E
from _engine_common import C, SPEC, tm

from mrl import checkpoint
from mrl.engine.objectives import PolicyObjective

OBJ = PolicyObjective(loss="ppo", eps_low=0.2, eps_high=0.28, clip_c=3.0)
DIST = sys.argv[2] == "distributed"
LOAD_TP = 2 if DIST else 1
MODE = f"{sys.argv[2]}_tp2_to_tp{LOAD_TP}"
EXTRA = {"sampler": {"epoch": 1, "cursor": 17}, "kl_coef": 0.002}


def main(root):
    ctx = C.up(tensor=2)
    torch.manual_seed(42)
    ref_model = tm.build_tiny_gpt(SPEC)  # TP-sharded build; only used for its full weights below
    del ref_model
    C.down()

    ctx = C.up(tensor=1)
    torch.manual_seed(42)
    ref = tm.build_tiny_gpt(SPEC)
    C.perturb_(ref, seed=43)
    params0 = C.full_params(ref)
    batch_a = E.with_old_logprobs(ref, E.synthetic_batch(seed=7))
    batch_b = E.with_old_logprobs(ref, E.synthetic_batch(seed=8))
    C.down()

    ctx = C.up(tensor=2)  # DP = 1
    eng = E.actor_engine(params0, distributed=DIST, warmup=2, total_steps=6, clip=1.0)
    eng.train_mini_batch(batch_a, OBJ, micro_batch_tokens=64)
    checkpoint.save(root, 1, chunks=eng.chunks, optimizer=eng.optimizer, scheduler=eng.scheduler, extra=EXTRA)
    cont = eng.train_mini_batch(batch_b, OBJ, micro_batch_tokens=64)
    after_tp2 = {n: p.detach().clone() for n, p in eng.chunks[0].module.named_parameters()}
    tp_rank = ctx.layout.tp_rank
    C.down()

    ctx = C.up(seed=999, tensor=LOAD_TP)  # a different initialisation that the load must overwrite
    eng = E.actor_engine(None, distributed=DIST, warmup=2, total_steps=6, clip=1.0)
    got = checkpoint.load(root, chunks=eng.chunks, optimizer=eng.optimizer, scheduler=eng.scheduler)
    assert got.step == 1 and got.extra == EXTRA, (got.step, got.extra)
    assert got.rng_restored == (LOAD_TP == 2)  # RNG streams only come back on the saving layout
    assert eng.scheduler.num_steps == 1
    res = eng.train_mini_batch(batch_b.dp_shard(ctx.dp_rank, ctx.dp), OBJ, micro_batch_tokens=64)
    print(f"rank {ctx.rank}: continued loss {cont['loss']!r} resumed {res['loss']!r}; lr {cont['lr']} {res['lr']}",
          flush=True)
    C.report(f"resume_{MODE}_loss", abs(res["loss"] - cont["loss"]))
    C.report(f"resume_{MODE}_grad_norm", abs(res["grad_norm"] - cont["grad_norm"]))
    C.report(f"resume_{MODE}_lr", abs(res["lr"] - cont["lr"]))
    worst = 0.0
    for n, p in eng.chunks[0].module.named_parameters():
        worst = max(worst, C.check(f"param {n} after resumed step",
                                   p.detach() if LOAD_TP == 2 else
                                   C.shard(n, p.detach(), 2, tp_rank, num_query_groups=SPEC.num_query_groups),
                                   after_tp2[n], tol=1e-6))
    C.report(f"resume_{MODE}_params", worst)
    C.down()


if __name__ == "__main__":
    C.main_guard(lambda: main(sys.argv[1]))
