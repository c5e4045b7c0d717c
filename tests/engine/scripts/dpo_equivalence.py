"""Online DPO's loss and gradients through the engine equal one naive call over the whole
mini-batch, whatever the micro-batch split, padding and data-parallel layout (2 ranks, gloo).

Reference: unpacked log-probs (one forward per sequence, torch log-softmax) of every row of the
mini-batch, sequence sums, the pairs of `mrl.algos.dpo.preference_pairs`, the mean pair loss,
autograd. Compared with it: `mrl.train.dpo.mini_batch` (no-grad pass, coefficients, engine
forward/backward with `PairwiseObjective`) at DP=2 (1, 2 and 4 micro-batches per rank) and at
TP=2 x DP=1 (1 and 3 micro-batches), each on the batch as built and with extra padding, and at
CP=2 x DP=1 (1 and 3 micro-batches: a response's sequence log-prob adds tokens of both CP ranks).
"""
import types

import torch

import _engine_common as E
from _engine_common import C, SPEC

from mrl.algos import dpo
from mrl.batch import Batch
from mrl.engine.objectives import PairwiseObjective
from mrl.train.dpo import mini_batch

# vs the naive reference: IPO's gradient is (h - 1/(2 beta)) * dS/dtheta, so float32 rounding of the
# packed vs unpacked log-probs in h reaches it undamped (measured 1.7e-6 relative); across splits,
# paddings and layouts the engine's own results agree to TOL
TOL = 1e-6
NAIVE_TOL = {"dpo": 1e-6, "ipo": 1e-5, "simpo": 1e-6}
CFGS = {"dpo": types.SimpleNamespace(loss="dpo", beta=0.5, gamma=0.0),
        "ipo": types.SimpleNamespace(loss="ipo", beta=5.0, gamma=0.0),
        "simpo": types.SimpleNamespace(loss="simpo", beta=2.0, gamma=0.3)}


def dpo_batch():
    """4 prompts x 3 responses; scores with ties (prompt 3's are all equal: dropped), reference
    log-probs = the model's own plus noise."""
    ref_model, params0, batch = E.reference_setup(prompts=4, per_prompt=3)
    scores = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.9, 0.2, 0.0, 0.0, 1.0, 0.3, 0.3, 0.3])
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        lp = E.naive_logprobs(ref_model, batch)
    ref = (lp + 0.2 * torch.randn(lp.shape, generator=g)) * batch["response_mask"]
    return ref_model, params0, batch.add(rewards=scores, ref_logprobs=ref)


def widen(batch: Batch, extra: int) -> Batch:
    """The same rows with `extra` more padding columns on the prompt (left) and response (right)."""
    t = dict(batch.tensors)
    for k in ("prompt_ids", "prompt_mask"):
        t[k] = torch.nn.functional.pad(t[k], (extra, 0))
    for k, v in batch.tensors.items():
        if v.dim() == 2 and v.shape[1] == batch.response_width:
            t[k] = torch.nn.functional.pad(v, (0, extra))
    return Batch(t, batch.meta)


def naive(model, batch: Batch, cfg):
    model.zero_grad(set_to_none=True)
    mask = batch["response_mask"]
    seq = dpo.sequence_logps(E.naive_logprobs(model, batch), mask)
    ref = dpo.sequence_logps(batch["ref_logprobs"], mask)
    chosen, rejected, dropped = dpo.preference_pairs(batch["rewards"], batch["group_index"])
    assert len(chosen) == 3 and dropped == 1
    loss = dpo.pair_loss(seq, ref, (mask > 0).sum(-1), chosen, rejected, cfg.loss, cfg.beta, cfg.gamma).mean()
    loss.backward()
    return float(loss), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def engine_pass(mine: Batch, params0, cfg, budget: int, expect_mbs: int):
    eng = E.actor_engine(params0)
    chosen, rejected, _ = dpo.preference_pairs(mine["rewards"], mine["group_index"])
    pairs = torch.tensor([float(len(chosen))])
    torch.distributed.all_reduce(pairs, group=eng.dp_group)

    def apply(b, obj):
        return eng.forward_backward(b, obj, micro_batch_tokens=budget)

    m, _, _ = mini_batch(eng, mine, cfg, PairwiseObjective(), apply, logprob_budget=budget, chosen=chosen,
                         rejected=rejected, pairs=float(pairs))
    assert m["micro_batches"] == expect_mbs, m
    assert m["pass_drift"] < 1e-5, m
    return eng, m


def compare(tag, eng, m, want_loss, want, tol, tp=1, tp_rank=0):
    """Gradients and loss, relative to the larger of 1 and the largest gradient entry (IPO's
    squared loss has gradients of several units)."""
    worst = 0.0
    scale = max([1.0] + [float(w.abs().max()) for w in want.values()])
    for n, g in E_grads(eng).items():
        w = C.shard(n, want[n], tp, tp_rank, num_query_groups=SPEC.num_query_groups)
        worst = max(worst, C.check(f"grad {n} ({tag})", g / scale, w / scale, tol=tol))
    C.report(f"{tag}_grads", worst)
    C.report(f"{tag}_loss", C.check(f"loss ({tag})", torch.tensor(m["loss"]) / max(1.0, abs(want_loss)),
                                    torch.tensor(want_loss) / max(1.0, abs(want_loss)), tol=tol))


def E_grads(eng):
    return {n: p.main_grad.detach().clone() for n, p in eng.chunks[0].module.named_parameters()}


def main():
    ctx = C.up(tensor=1)  # DP = 2
    model, params0, batch = dpo_batch()
    wants = {name: naive(model, batch, cfg) for name, cfg in CFGS.items()}
    halves = [batch.dp_shard(r, 2) for r in range(2)]
    lengths = [h.sequence_lengths.tolist() for h in halves]
    firsts = {}
    for name, cfg in CFGS.items():
        want_loss, want = wants[name]
        for k in (1, 2, 4):
            for extra in (0, 5):
                mine = widen(halves[ctx.dp_rank], extra)
                eng, m = engine_pass(mine, params0, cfg, E.budget_for(lengths, k), k)
                compare(f"dp2_{name}_mb{k}_pad{extra}", eng, m, want_loss, want, NAIVE_TOL[name])
                if name not in firsts:   # the engine's own first result: every split and padding against it
                    firsts[name] = (m["loss"], {n: g.clone() for n, g in E_grads(eng).items()})
                else:
                    compare(f"dp2_{name}_mb{k}_pad{extra}_vs_mb1", eng, m, firsts[name][0], firsts[name][1], TOL)
    C.down()

    ctx = C.up(tensor=2)  # DP = 1, vocabulary-parallel log-probs
    tp_rank = ctx.layout.tp_rank
    for name in ("dpo", "ipo"):
        want_loss, want = wants[name]
        for k in (1, 3):
            for extra in (0, 5):
                eng, m = engine_pass(widen(batch, extra), params0, CFGS[name],
                                     E.budget_for([batch.sequence_lengths.tolist()], k), k)
                compare(f"tp2_{name}_mb{k}_pad{extra}", eng, m, want_loss, want, NAIVE_TOL[name], tp=2, tp_rank=tp_rank)
    C.down()

    from cp_equivalence import budget_for   # per-rank budgets of 2N-chunked sequences

    C.up(context=2)  # DP = 1
    want_loss, want = wants["dpo"]
    for k in (1, 3):
        eng, m = engine_pass(batch, params0, CFGS["dpo"], budget_for(batch, k), k)
        compare(f"cp2_dpo_mb{k}", eng, m, want_loss, want, NAIVE_TOL["dpo"])
    C.down()


if __name__ == "__main__":
    C.main_guard(main)
