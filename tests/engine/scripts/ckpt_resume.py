"""Checkpoint at TP=2, load at other layouts: the next step equals continuing without the checkpoint.

Usage: ckpt_resume.py DIR KIND [KIND ...], KIND plain or distributed, each checkpointing under
DIR/KIND, one after another in this launch. `plain` (megatron's fp32 optimizer) loads at
TP=1 x DP=2. `distributed` (the distributed optimizer) loads at TP=2 x DP=1 (the saving layout)
and at TP=1 x DP=2, each into a fresh process group and model; at the saving layout it first
loads a checkpoint written before the first update (the optimizer had no state yet) and checks
that update too, and then a copy saved in the older torch_dist optimizer format (compat). The
TP=1 x DP=2 run saves again and that checkpoint loads at TP=2 x DP=1 (DP2 -> DP1: each rank's
optimizer shard reassembled by ranges) and at PP=2, whose save loads at PP=1 x DP=2. Model, optimizer state (Adam moments and step),
scheduler, step and `extra` must all round-trip; the next update's loss, grad norm, learning
rate and weights are compared."""
import sys

import torch

import _engine_common as E
from _engine_common import C, SPEC, tm

from mrl import checkpoint
from mrl.engine.objectives import PolicyObjective

OBJ = PolicyObjective(loss="ppo", eps_low=0.2, eps_high=0.28, clip_c=3.0)
EXTRA = {"sampler": {"epoch": 1, "cursor": 17}, "kl_coef": 0.002}


def params_of(eng) -> dict:
    return {n: p.detach().clone() for n, p in eng.chunks[0].module.named_parameters()}


def compare_params(eng, want: dict, load_tp: int, save_tp_rank: int, what: str) -> float:
    """Max difference of this rank's weights from the TP=2 run's (compared on rank `save_tp_rank`'s shard)."""
    worst = 0.0
    for n, p in eng.chunks[0].module.named_parameters():
        got = p.detach() if load_tp == 2 else C.shard(n, p.detach(), 2, save_tp_rank,
                                                      num_query_groups=SPEC.num_query_groups)
        worst = max(worst, C.check(f"param {n} after {what}", got, want[n], tol=1e-6))
    return worst


def report_resume(mode: str, cont: dict, res: dict, params_diff: float) -> None:
    C.report(f"resume_{mode}_loss", abs(res["loss"] - cont["loss"]))
    C.report(f"resume_{mode}_grad_norm", abs(res["grad_norm"] - cont["grad_norm"]))
    C.report(f"resume_{mode}_lr", abs(res["lr"] - cont["lr"]))
    C.report(f"resume_{mode}_params", params_diff)


def main(root, kind: str):
    dist_optim = kind == "distributed"
    old_format = root.with_name(root.name + "_torch_dist")
    ctx = C.up(tensor=1)
    torch.manual_seed(42)
    ref = tm.build_tiny_gpt(SPEC)
    C.perturb_(ref, seed=43)
    params0 = C.full_params(ref)
    batch_a = E.with_old_logprobs(ref, E.synthetic_batch(seed=7))
    batch_b = E.with_old_logprobs(ref, E.synthetic_batch(seed=8))
    batch_c = E.with_old_logprobs(ref, E.synthetic_batch(seed=9))
    batch_d = E.with_old_logprobs(ref, E.synthetic_batch(seed=10))
    C.down()

    ctx = C.up(tensor=2)  # DP = 1
    eng = E.actor_engine(params0, distributed=dist_optim, warmup=2, total_steps=6, clip=1.0)
    if dist_optim:
        checkpoint.save(root, 0, chunks=eng.chunks, optimizer=eng.optimizer, scheduler=eng.scheduler)
    first = eng.train_mini_batch(batch_a, OBJ, micro_batch_tokens=64)
    after_a = params_of(eng)
    checkpoint.save(root, 1, chunks=eng.chunks, optimizer=eng.optimizer, scheduler=eng.scheduler, extra=EXTRA)
    if dist_optim:
        checkpoint.save(old_format, 1, chunks=eng.chunks, optimizer=eng.optimizer, scheduler=eng.scheduler,
                        extra=EXTRA, optimizer_format="torch_dist")
    # the optimizer in mrl's per-rank format (its own files), the copy in the torch_dist one
    assert (root / "step_00000001" / "optim").is_dir()
    assert not dist_optim or not (old_format / "step_00000001" / "optim").exists()
    cont = eng.train_mini_batch(batch_b, OBJ, micro_batch_tokens=64)
    after_b = params_of(eng)
    tp_rank = ctx.layout.tp_rank
    C.down()

    loads = [(2, root), (2, old_format), (1, root)] if dist_optim else [(1, root)]
    for load_tp, where in loads:
        mode = f"{kind}_tp2_to_tp{load_tp}" + ("_torch_dist" if where == old_format else "")
        ctx = C.up(seed=999, tensor=load_tp)  # a different initialisation that the load must overwrite
        eng = E.actor_engine(None, distributed=dist_optim, warmup=2, total_steps=6, clip=1.0)
        if dist_optim and load_tp == 2 and where == root:  # the checkpoint from before the first update
            got = checkpoint.load(root / "step_00000000", chunks=eng.chunks, optimizer=eng.optimizer,
                                  scheduler=eng.scheduler)
            assert got.step == 0 and eng.scheduler.num_steps == 0, (got.step, eng.scheduler.num_steps)
            res = eng.train_mini_batch(batch_a, OBJ, micro_batch_tokens=64)
            worst = compare_params(eng, after_a, load_tp, tp_rank, "the first update")
            C.report("resume_distributed_before_first_update",
                     max(worst, abs(res["loss"] - first["loss"]), abs(res["grad_norm"] - first["grad_norm"])))
        got = checkpoint.load(where, chunks=eng.chunks, optimizer=eng.optimizer, scheduler=eng.scheduler)
        assert got.step == 1 and got.extra == EXTRA, (got.step, got.extra)
        assert got.rng_restored == (load_tp == 2)  # RNG streams only come back on the saving layout
        assert eng.scheduler.num_steps == 1
        res = eng.train_mini_batch(batch_b.dp_shard(ctx.dp_rank, ctx.dp), OBJ, micro_batch_tokens=64)
        print(f"rank {ctx.rank} {mode}: continued loss {cont['loss']!r} resumed {res['loss']!r}; "
              f"lr {cont['lr']} {res['lr']}", flush=True)
        report_resume(mode, cont, res, compare_params(eng, after_b, load_tp, tp_rank, "the resumed update"))
        if dist_optim and load_tp == 1:
            # DP2 -> DP1: save at TP=1 x DP=2, go on one update; load at TP=2 x DP=1, the same update
            again = root.with_name(root.name + "_dp2")
            checkpoint.save(again, 2, chunks=eng.chunks, optimizer=eng.optimizer, scheduler=eng.scheduler)
            cont_c = eng.train_mini_batch(batch_c.dp_shard(ctx.dp_rank, ctx.dp), OBJ, micro_batch_tokens=64)
            after_c = params_of(eng)   # full (TP=1) weights
            C.down()
            ctx = C.up(seed=998, tensor=2)
            eng = E.actor_engine(None, distributed=True, warmup=2, total_steps=6, clip=1.0)
            got = checkpoint.load(again, chunks=eng.chunks, optimizer=eng.optimizer, scheduler=eng.scheduler)
            assert got.step == 2 and eng.scheduler.num_steps == 2, (got.step, eng.scheduler.num_steps)
            res = eng.train_mini_batch(batch_c, OBJ, micro_batch_tokens=64)
            worst = 0.0
            for n, p in eng.chunks[0].module.named_parameters():
                want = C.shard(n, after_c[n], 2, ctx.layout.tp_rank, num_query_groups=SPEC.num_query_groups)
                worst = max(worst, C.check(f"param {n} after the DP2 -> DP1 resume", p.detach(), want, tol=1e-6))
            report_resume("distributed_dp2_to_dp1", cont_c, res, worst)
            C.down()
            pipeline_phases(again, root.with_name(root.name + "_pp2"), cont_c, after_c, batch_c, batch_d)
        else:
            C.down()


def pipeline_phases(again, pp_root, cont_c, after_c, batch_c, batch_d):
    """PP: the TP=1 x DP=2 checkpoint loads at PP=2 (each rank half the layers) and continues like
    the DP=2 run; a save there (step 3) loads at PP=1 x DP=2 and continues like the PP=2 run."""
    from megatron.core import parallel_state as ps

    C.up(seed=997, pipeline=2)   # DP = 1
    model = tm.build_tiny_gpt(SPEC)
    eng = E.actor_engine(None, distributed=True, warmup=2, total_steps=6, clip=1.0, chunks=[model])
    got = checkpoint.load(again, chunks=eng.chunks, optimizer=eng.optimizer, scheduler=eng.scheduler)
    assert got.step == 2, got.step
    res = eng.train_mini_batch(batch_c, OBJ, micro_batch_tokens=64)
    offset = ps.get_pipeline_model_parallel_rank() * SPEC.num_layers // 2
    worst = max(C.check(f"param {n} after the DP2 -> PP2 resume", p.detach(), after_c[E._global_name(n, offset)],
                        tol=1e-6) for n, p in model.named_parameters())
    report_resume("distributed_dp2_to_pp2", cont_c, res, worst)
    checkpoint.save(pp_root, 3, chunks=eng.chunks, optimizer=eng.optimizer, scheduler=eng.scheduler)
    cont_d = eng.train_mini_batch(batch_d, OBJ, micro_batch_tokens=64)
    after_d = {E._global_name(n, offset): p.detach().clone() for n, p in model.named_parameters()}
    C.down()

    ctx = C.up(seed=996, tensor=1)   # PP = 1, DP = 2
    eng = E.actor_engine(None, distributed=True, warmup=2, total_steps=6, clip=1.0)
    got = checkpoint.load(pp_root, chunks=eng.chunks, optimizer=eng.optimizer, scheduler=eng.scheduler)
    assert got.step == 3 and eng.scheduler.num_steps == 3, (got.step, eng.scheduler.num_steps)
    res = eng.train_mini_batch(batch_d.dp_shard(ctx.dp_rank, ctx.dp), OBJ, micro_batch_tokens=64)
    # each rank compares the layers its PP=2 stage held (together: every weight)
    worst = max(C.check(f"param {n} after the PP2 -> PP1 resume", p.detach(), after_d[n], tol=1e-6)
                for n, p in eng.chunks[0].module.named_parameters() if n in after_d)
    report_resume("distributed_pp2_to_pp1", cont_d, res, worst)
    C.down()


if __name__ == "__main__":
    from pathlib import Path

    C.main_guard(lambda: [main(Path(sys.argv[1]) / kind, kind) for kind in sys.argv[2:]])
