"""TP2 x CP2 and PP2 x CP2 on 4 ranks (gloo) equal one naive whole-batch call: eval log-probs,
loss and every gradient (each rank's TP shard, or its pipeline stage's layers) of token-mean PPO
on a packed uneven batch, at 1 and 3 micro-batches (under PP the stages exchange the CP ranks'
local rows, whose lengths differ per micro-batch). Run by the GPU tier (4 CPU ranks; the CPU CI
machine has 2 cores)."""
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

    ctx = up(pipeline=2, context=2)   # DP = 1
    assert ctx.layout.cp == 2 and ctx.layout.pp == 2, ctx.layout
    from megatron.core import parallel_state as ps

    offset = ps.get_pipeline_model_parallel_rank() * SPEC.num_layers // 2

    def stage_engine():
        model = E.tm.build_tiny_gpt(SPEC)
        E.load_full(model, params0, 1, 0, layer_offset=offset)
        return E.actor_engine(None, chunks=[model])

    got = stage_engine().forward_only(batch, actor_outputs(), micro_batch_tokens=CPE.budget_for(batch, 2))["logprobs"]
    C.report("pp2_cp2_eval_logprobs", C.check("pp2 x cp2 logprobs", got, want_logp, tol=1e-5))
    for k in (1, 3):
        eng = stage_engine()
        m = eng.forward_backward(batch, CPE.PPO, micro_batch_tokens=CPE.budget_for(batch, k))
        assert m["micro_batches"] == max(k, 2), m   # the schedule takes at least PP micro-batches
        worst = max(C.check(f"grad {n} (pp2 x cp2, {k} micro-batches)", g, want[E._global_name(n, offset)], tol=1e-6)
                    for n, g in CPE.grads_of(eng).items())
        C.report(f"pp2_cp2_mb{k}_grads", worst)
        C.report(f"pp2_cp2_mb{k}_loss", abs(m["loss"] - want_loss))
    teardown()


if __name__ == "__main__":
    C.main_guard(main)
