"""The engine's gradients do not depend on how a mini-batch is split (2 ranks, gloo).

Reference: one naive call over the whole mini-batch (unpacked sequences, positions from 0, torch
log-softmax, token-mean PPO loss) on a bare TP=1 model. Compared with it:
- packed eval log-probs (block-diagonal mask, RoPE over the row) = unpacked log-probs;
- DP=2 with 1, 2 and 4 token-balanced micro-batches per rank: loss, every gradient, grad norm;
- the distributed optimizer's grad norm; TP=2 (DP=1) gradients; PP=2 (DP=1) loss and grad norm;
- a NaN in the loss: policy 'skip' leaves the weights and schedule alone, 'stop' raises.
"""
import torch

import _engine_common as E
from _engine_common import C, SPEC, tm

from mrl.engine.objectives import PolicyObjective, actor_outputs
from mrl.optim import NonFiniteError

OBJ = PolicyObjective(loss="ppo", eps_low=0.2, eps_high=0.28, clip_c=3.0)
TOL = 1e-6


def grads_of(engine):
    return {n: p.main_grad.detach().clone() for n, p in engine.chunks[0].module.named_parameters()}


def main():
    ctx = C.up(tensor=1)  # DP = 2
    ref, params0, batch = E.reference_setup()
    want_loss, want = E.naive_loss_and_grads(ref, batch)
    want_norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in want.values())))
    halves = [batch.dp_shard(r, 2) for r in range(2)]
    mine = halves[ctx.dp_rank]
    lengths = [h.sequence_lengths.tolist() for h in halves]

    # packed eval pass == unpacked forward
    eng = E.actor_engine(params0)
    budget = E.budget_for(lengths, 2)
    got = eng.forward_only(mine, actor_outputs(), micro_batch_tokens=budget)["logprobs"]
    with torch.no_grad():
        exp = E.naive_logprobs(ref, mine)
    C.report("packed_vs_unpacked_logprobs", C.check("packed logprobs", got, exp, tol=1e-5))

    for k in (1, 2, 4):
        eng = E.actor_engine(params0)
        m = eng.forward_backward(mine, OBJ, micro_batch_tokens=E.budget_for(lengths, k))
        assert m["micro_batches"] == k, m
        worst = max(C.check(f"grad {n} (k={k})", g, want[n], tol=TOL) for n, g in grads_of(eng).items())
        C.report(f"dp2_mb{k}_grads", worst)
        C.report(f"dp2_mb{k}_loss", abs(m["loss"] - want_loss))
        from mrl.optim import guarded_step

        outcome = guarded_step(eng.optimizer, None, loss=m["loss"], clip=0.0, policy="stop", where="test")
        C.report(f"dp2_mb{k}_grad_norm", abs(outcome.grad_norm - want_norm) / want_norm)

    eng = E.actor_engine(params0, distributed=True)
    m = eng.train_mini_batch(mine, OBJ, micro_batch_tokens=E.budget_for(lengths, 2))
    C.report("dp2_distributed_optimizer_grad_norm", abs(m["grad_norm"] - want_norm) / want_norm)
    assert m["updated"] == 1.0 and m["lr"] > 0

    # NaN policies
    bad = mine
    if ctx.rank == 0:
        adv = mine["advantages"].clone()
        adv[0] = float("nan")
        bad = mine.select(range(len(mine)))
        bad.tensors["advantages"] = adv
    eng = E.actor_engine(params0, nonfinite="skip")
    m = eng.train_mini_batch(bad, OBJ, micro_batch_tokens=10_000, step=5)
    assert m["updated"] == 0.0, m
    assert eng.scheduler.num_steps == 0
    unchanged = max((p.detach() - C.shard(n, params0[n], 1, 0, num_query_groups=SPEC.num_query_groups)).abs().max().item()
                    for n, p in eng.chunks[0].module.named_parameters())
    assert unchanged == 0.0, unchanged
    m = eng.train_mini_batch(mine, OBJ, micro_batch_tokens=10_000, step=6)
    assert m["updated"] == 1.0 and eng.scheduler.num_steps == 1
    eng = E.actor_engine(params0, nonfinite="stop")
    try:
        eng.train_mini_batch(bad, OBJ, micro_batch_tokens=10_000, step=5)
        raise AssertionError("a NaN loss must stop the run")
    except NonFiniteError as e:
        assert "step 5" in str(e) and "actor update" in str(e), str(e)
    C.report("nan_policies", 0.0)
    C.down()

    ctx = C.up(tensor=2)  # DP = 1
    eng = E.actor_engine(params0)
    full_lengths = [batch.sequence_lengths.tolist()]
    # sum_v pi_v^2 (the optimal token baselines') from vocabulary-parallel logits == the full softmax's
    got = eng.forward_only(batch, actor_outputs(pi_squared=True),
                           micro_batch_tokens=E.budget_for(full_lengths, 2))["sum_pi_squared"]
    with torch.no_grad():
        exp = E.naive_per_token(ref, batch, lambda logits, pos, labels: torch.softmax(logits.float(), -1)[pos]
                                .square().sum(-1))
    C.report("tp2_sum_pi_squared", C.check("sum pi^2 (tp2)", got, exp, tol=1e-5))
    m = eng.forward_backward(batch, OBJ, micro_batch_tokens=E.budget_for(full_lengths, 2))
    tp_rank = ctx.layout.tp_rank
    worst = max(C.check(f"grad {n} (tp2)", g, C.shard(n, want[n], 2, tp_rank, num_query_groups=SPEC.num_query_groups),
                        tol=TOL) for n, g in grads_of(eng).items())
    C.report("tp2_grads", worst)
    C.report("tp2_loss", abs(m["loss"] - want_loss))
    from mrl.optim import guarded_step

    outcome = guarded_step(eng.optimizer, None, loss=m["loss"], clip=0.0, policy="stop", where="test")
    C.report("tp2_grad_norm", abs(outcome.grad_norm - want_norm) / want_norm)
    C.down()

    ctx = C.up(pipeline=2)  # DP = 1
    from megatron.core import parallel_state as ps

    model = tm.build_tiny_gpt(SPEC)
    offset = ps.get_pipeline_model_parallel_rank() * SPEC.num_layers // 2
    E.load_full(model, params0, 1, 0, layer_offset=offset)
    eng = E.actor_engine(None, chunks=[model])
    m = eng.forward_backward(batch, OBJ, micro_batch_tokens=E.budget_for(full_lengths, 3))
    assert m["micro_batches"] == 3, m
    worst = max(C.check(f"grad {n} (pp2)", g, want[E._global_name(n, offset)], tol=TOL)
                for n, g in grads_of(eng).items())
    C.report("pp2_grads", worst)
    C.report("pp2_loss", abs(m["loss"] - want_loss))
    outcome = guarded_step(eng.optimizer, None, loss=m["loss"], clip=0.0, policy="stop", where="test")
    C.report("pp2_grad_norm", abs(outcome.grad_norm - want_norm) / want_norm)
    C.down()

    C.up(pipeline=2)
    model = tm.build_tiny_gpt(SPEC)
    E.load_full(model, params0, 1, 0, layer_offset=ps.get_pipeline_model_parallel_rank() * SPEC.num_layers // 2)
    eng = E.actor_engine(None, chunks=[model])
    got = eng.forward_only(batch, actor_outputs(), micro_batch_tokens=E.budget_for(full_lengths, 2))["logprobs"]
    with torch.no_grad():
        exp = E.naive_logprobs(ref, batch)
    C.report("pp2_eval_logprobs", C.check("pp2 logprobs", got, exp, tol=1e-5))
    C.down()


if __name__ == "__main__":
    C.main_guard(main)
