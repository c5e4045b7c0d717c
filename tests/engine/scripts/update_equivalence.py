"""`Engine.update` (epochs x mini-batches x shuffle) on 2 data-parallel ranks.

2 epochs x 2 mini-batches must be 4 optimizer updates; the shuffled order must be seeded (the same
for the same seed and step, another for another seed), differ from the unshuffled order and
between epochs, and deal out every prompt exactly once per epoch with its responses together;
and `update` must equal training the planned mini-batches one by one with `train_mini_batch`.
"""
import torch

import _engine_common as E
from _engine_common import C

from mrl.engine import Engine
from mrl.engine.objectives import PolicyObjective

OBJ = PolicyObjective(loss="ppo", eps_low=0.2, eps_high=0.28, clip_c=3.0)


def order(plan) -> list[tuple[int, list[int]]]:
    """(epoch, prompt ids in first-appearance order) per planned mini-batch."""
    return [(e, list(dict.fromkeys(mb["group_index"].tolist()))) for e, mb in plan]


def main():
    ctx = C.up(tensor=1)  # DP = 2
    ref, params0, batch = E.reference_setup(prompts=16, per_prompt=2)
    mine = batch.dp_shard(ctx.dp_rank, ctx.dp)  # 8 prompts per rank
    kw = dict(mini_batches=2, epochs=2, shuffle=True, seed=3, step=5)

    plan = Engine.mini_batch_plan(mine, **kw)
    assert order(plan) == order(Engine.mini_batch_plan(mine, **kw)), "the shuffle must be deterministic"
    assert order(plan) != order(Engine.mini_batch_plan(mine, **{**kw, "seed": 4})), "the seed must matter"
    assert order(plan) != order(Engine.mini_batch_plan(mine, **{**kw, "step": 6})), "the step must matter"
    plain = order(Engine.mini_batch_plan(mine, **{**kw, "shuffle": False}))
    prompts = list(dict.fromkeys(mine["group_index"].tolist()))
    assert plain == [(e, prompts[k * 4:(k + 1) * 4]) for e in (0, 1) for k in (0, 1)], plain
    assert order(plan) != plain and order(plan)[:2] != [(0, o) for _, o in order(plan)[2:]], order(plan)
    for epoch in (0, 1):
        seen = [g for e, o in order(plan) if e == epoch for g in o]
        assert sorted(seen) == sorted(prompts), (epoch, seen)
        rows = sum(len(mb) for e, mb in plan if e == epoch)
        assert rows == len(mine), (rows, len(mine))

    eng = E.actor_engine(params0, total_steps=10, warmup=1, clip=1.0)
    records = eng.update(mine, OBJ, micro_batch_tokens=40, **kw)
    assert len(records) == 4 and [r["epoch"] for r in records] == [0.0, 0.0, 1.0, 1.0], records
    assert eng.steps == 4 and eng.scheduler.num_steps == 4, (eng.steps, eng.scheduler.num_steps)
    inner = getattr(eng.optimizer, "chained_optimizers", None) or [eng.optimizer]
    adam_steps = {float(st["step"]) for o in inner for st in o.optimizer.state.values()}
    assert adam_steps == {4.0}, adam_steps

    hand = E.actor_engine(params0, total_steps=10, warmup=1, clip=1.0)
    by_hand = [hand.train_mini_batch(mb, OBJ, micro_batch_tokens=40, step=5) for _, mb in plan]
    worst = 0.0
    for r, h in zip(records, by_hand):
        for k in ("loss", "grad_norm", "lr"):
            worst = max(worst, abs(r[k] - h[k]))
    for (n, p), q in zip(eng.chunks[0].module.named_parameters(), hand.chunks[0].module.parameters()):
        worst = max(worst, C.check(f"param {n} after update", p, q, tol=0.0))
    assert records[0]["lr"] == 0.0 and records[1]["lr"] > 0, [r["lr"] for r in records]  # warm-up, then steps
    C.report("update_vs_by_hand", worst)
    C.down()


if __name__ == "__main__":
    C.main_guard(main)
