"""TP2 x CP2 on 4 ranks (gloo) equals one naive whole-batch call: eval log-probs, loss and every
gradient (each rank's TP shard) of token-mean PPO on a packed uneven batch, at 1 and 3
micro-batches. Run by the GPU tier (4 CPU ranks; the CPU CI machine has 2 cores)."""
import torch

import _engine_common as E
from _engine_common import C, SPEC

from mrl.engine.objectives import actor_outputs
from mrl.platform import setup, teardown
from mrl.platform.config import ParallelConfig, PlatformConfig

import cp_equivalence as CPE


def up(**parallel):
    return setup(PlatformConfig(device="cpu", nodes=1, ranks_per_node=4, collective_timeout_s=300),
                 ParallelConfig(**parallel), seed=1234)


def main():
    up(tensor=1)   # DP = 4: the bare reference model
    ref, params0, batch = E.reference_setup(prompts=4, per_prompt=3)
    want_loss, want = CPE.naive(ref, batch, "ppo")
    with torch.no_grad():
        want_logp = E.naive_logprobs(ref, batch)
    teardown()

    ctx = up(tensor=2, context=2)   # DP = 1
    assert ctx.layout.cp == 2 and ctx.layout.tp == 2, ctx.layout
    tp_rank = ctx.layout.tp_rank
    eng = CPE.engine(params0, "float32")
    got = eng.forward_only(batch, actor_outputs(), micro_batch_tokens=CPE.budget_for(batch, 2))["logprobs"]
    C.report("tp2_cp2_eval_logprobs", C.check("tp2 x cp2 logprobs", got, want_logp, tol=1e-5))
    for k in (1, 3):
        loss, grads = CPE.run(params0, batch, CPE.PPO, "float32", k)
        worst = max(C.check(f"grad {n} (tp2 x cp2, {k} micro-batches)", g,
                            C.shard(n, want[n], 2, tp_rank, num_query_groups=SPEC.num_query_groups), tol=1e-6)
                    for n, g in grads.items())
        C.report(f"tp2_cp2_mb{k}_grads", worst)
        C.report(f"tp2_cp2_mb{k}_loss", abs(loss - want_loss))
    teardown()


if __name__ == "__main__":
    C.main_guard(main)
