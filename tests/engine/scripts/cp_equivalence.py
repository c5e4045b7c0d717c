"""Context parallelism: CP=2 equals CP=1 (2 ranks, gloo; one launch for every check).

Reference: one naive call over the whole mini-batch (unpacked sequences, dense-mask attention,
torch log-softmax) on a bare fp32 model. Phases:
- CP1 (DP=2, both ranks given the whole batch: the DP average then equals one rank's whole-batch
  gradient): fp32 at 1 and 3 micro-batches, bf16 at 1 to 4; the largest bf16 difference of
  another packing from 1 micro-batch is the bf16 noise floor (issue 37's criterion);
- CP2 (DP=1): fp32 eval log-probs, loss and every gradient of token-mean PPO and of GSPO with
  seq-mean-token-mean (whole-sequence ratios across the two CP ranks) against the reference;
  bf16 loss and gradients at 1 and 3 micro-batches against bf16 CP1 at 1: within the noise floor
  (the CPU kernel rounds CP2's split softmax as CP1's whole one, `mrl.models.flash_cpu`), and at
  the same packing the loss is CP1's to float32 rounding;
- GRPO (group-normalised advantages of random scores, Adam, warm-up, clipping): two updates at
  CP2 equal two at CP1 (loss, grad norm, weights);
- on-policy distillation at CP2 equals CP1 (fp32): the full-vocabulary reverse KL to a frozen
  teacher that runs on each packed micro-batch under the same CP layout, its per-token values
  gathered over CP (loss, every gradient, the `distill_kl` metric, at 1 and 3 micro-batches), and
  the sampled estimator's teacher log-probs (the teacher's eval pass);
- resume across a CP change: a checkpoint saved at CP2 after the first update, loaded at CP1 into
  a differently initialised model, gives the second update CP2 gave.
The batch has uneven lengths (3 to 20 tokens) so sequences are padded to 2N chunks.

Usage: cp_equivalence.py CHECKPOINT_DIR
"""
import sys
from pathlib import Path

import dataclasses

import torch

import _engine_common as E
from _engine_common import C, SPEC, tm

from mrl import checkpoint
from mrl.algos import advantages, losses
from mrl.engine import Engine
from mrl.engine.objectives import PolicyObjective, actor_outputs
from mrl.train.teacher import Teacher, teacher_logprobs, teacher_rows

PPO = PolicyObjective(loss="ppo", eps_low=0.2, eps_high=0.28, clip_c=3.0)
BF16_PACKINGS = (1, 2, 3, 4)   # micro-batches: CP1's bf16 noise floor is the spread over these
GSPO = PolicyObjective(loss="gspo", eps_low=3e-4, eps_high=4e-4, aggregation="seq-mean-token-mean")


def grads_of(engine):
    return {n: p.main_grad.detach().clone().float() for n, p in engine.chunks[0].module.named_parameters()}


def naive(ref, batch, loss):
    ref.zero_grad(set_to_none=True)
    lp = E.naive_logprobs(ref, batch)
    if loss == "ppo":
        per_token, _ = losses.ppo(lp, batch["old_logprobs"], batch["advantages"], batch["response_mask"], 0.2, 0.28, 3.0)
        total = losses.aggregate(per_token, batch["response_mask"], "token-mean")
    else:
        per_token, _ = losses.gspo(lp, batch["old_logprobs"], batch["advantages"], batch["response_mask"], 3e-4, 4e-4)
        total = losses.aggregate(per_token, batch["response_mask"], "seq-mean-token-mean")
    total.backward()
    return float(total), {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def engine(params, dtype):
    model = None
    if dtype == "bfloat16":
        model = tm.build_tiny_gpt(SPEC, config=tm.tiny_gpt_config(SPEC, params_dtype=torch.bfloat16, bf16=True))
    return E.actor_engine(params, chunks=[model] if model is not None else None)


def budget_for(batch, count: int) -> int:
    """A per-rank token budget that packs `batch` into `count` micro-batches on this layout (under
    CP the engine plans sequences padded to 2N chunks against budget x N)."""
    from megatron.core import parallel_state as ps

    from mrl.engine import plan
    from mrl.models.context_parallel import padded_length

    cp = ps.get_context_parallel_world_size()
    lengths = [padded_length(n, cp) if cp > 1 else n for n in batch.sequence_lengths.tolist()]
    for b in range(1, 10_000):
        if b * cp >= max(lengths) and len(plan(lengths, b * cp)) == count:
            return b
    raise ValueError(f"no budget gives {count} micro-batches")


def run(params, batch, obj, dtype, micro_batches):
    eng = engine(params, dtype)
    budget = budget_for(batch, micro_batches)
    m = eng.forward_backward(batch, obj, micro_batch_tokens=budget)
    assert m["micro_batches"] == micro_batches, m
    return m["loss"], grads_of(eng)


def teacher_setup():
    """The full weights of a frozen teacher: another seeded, perturbed tiny model."""
    torch.manual_seed(77)
    t = tm.build_tiny_gpt(SPEC)
    C.perturb_(t, seed=78, scale=0.3)
    return C.full_params(t)


def teacher_of(params) -> Teacher:
    model = tm.build_tiny_gpt(SPEC)
    E.load_full(model, params, 1, 0)
    model.eval()
    model.requires_grad_(False)
    return Teacher(engine=Engine([model], name="teacher"), vocab_size=SPEC.vocab_size)


def distill(params, batch, teacher_params, micro_batches):
    """(loss, grads, distill_kl metric, teacher's sampled log-probs) of PPO + 0.5 x the full reverse
    KL to the teacher, on this layout (fp32)."""
    teacher = teacher_of(teacher_params)
    obj = dataclasses.replace(PPO, distill_coef=0.5, teacher_rows=teacher_rows(teacher))
    eng = engine(params, "float32")
    m = eng.forward_backward(batch, obj, micro_batch_tokens=budget_for(batch, micro_batches))
    assert m["micro_batches"] == micro_batches and m["distill_kl"] > 0.01, m
    sampled, _ = teacher_logprobs(teacher, batch, budget_for(batch, 2), 1.0, "torch")
    return m["loss"], grads_of(eng), m["distill_kl"], sampled


def grpo_batch(ref):
    b = E.with_old_logprobs(ref, E.synthetic_batch(prompts=4, per_prompt=3, seed=11), seed=12)
    scores = torch.randn(len(b), generator=torch.Generator().manual_seed(13))
    b.tensors["advantages"] = advantages.grpo(scores, b["group_index"])
    return b


def trainer(params):
    return E.actor_engine(params, warmup=1, total_steps=4, clip=1.0)


def params_of(eng) -> dict:
    return {n: p.detach().clone() for n, p in eng.chunks[0].module.named_parameters()}


def worst(a: dict, b: dict) -> float:
    return max((a[n].double() - b[n].double()).abs().max().item() for n in a)


def main(root: Path):
    C.up(tensor=1)   # DP = 2, each rank the whole batch
    ref, params0, batch = E.reference_setup(prompts=4, per_prompt=3)
    want = {loss: naive(ref, batch, loss) for loss in ("ppo", "gspo")}
    cp1 = {("float32", k): run(params0, batch, PPO, "float32", k) for k in (1, 3)}
    cp1.update({("bfloat16", k): run(params0, batch, PPO, "bfloat16", k) for k in BF16_PACKINGS})
    teacher_params = teacher_setup()
    cp1_distill = distill(params0, batch, teacher_params, 1)
    g_batch = grpo_batch(ref)
    eng = trainer(params0)
    cp1_steps = [eng.train_mini_batch(g_batch, PPO, micro_batch_tokens=32) for _ in range(2)]
    cp1_params = params_of(eng)
    C.down()
    base = cp1["bfloat16", 1]
    noise_loss = max(abs(cp1["bfloat16", k][0] - base[0]) for k in BF16_PACKINGS[1:])
    noise_grads = max(worst(cp1["bfloat16", k][1], base[1]) for k in BF16_PACKINGS[1:])

    C.up(context=2)   # DP = 1, CP = 2
    eng = engine(params0, "float32")
    got = eng.forward_only(batch, actor_outputs(entropy=True), micro_batch_tokens=budget_for(batch, 2))
    with torch.no_grad():
        exp = E.naive_logprobs(ref, batch)
    C.report("cp2_eval_logprobs", C.check("cp2 logprobs", got["logprobs"], exp, tol=1e-5))
    for loss, obj in (("ppo", PPO), ("gspo", GSPO)):
        for k in (1, 3):
            got_loss, got_grads = run(params0, batch, obj, "float32", k)
            C.report(f"cp2_{loss}_mb{k}_loss", abs(got_loss - want[loss][0]))
            C.report(f"cp2_{loss}_mb{k}_grads", worst(got_grads, want[loss][1]))
    C.report("cp1_fp32_vs_naive_grads", worst(cp1["float32", 3][1], want["ppo"][1]))
    bf = {k: run(params0, batch, PPO, "bfloat16", k) for k in (1, 3)}
    C.report("bf16_noise_floor_loss", noise_loss)
    C.report("bf16_noise_floor_grads", noise_grads)
    cp2_loss = max(abs(bf[k][0] - base[0]) for k in bf)
    cp2_grads = max(worst(bf[k][1], base[1]) for k in bf)
    C.report("bf16_cp2_vs_cp1_loss", cp2_loss)
    C.report("bf16_cp2_vs_cp1_grads", cp2_grads)
    # the criterion: CP2 - CP1 within CP1's packing-to-packing spread (a 0 floor: 0 allowed)
    C.report("bf16_cp2_vs_cp1_over_noise_floor_loss", cp2_loss / noise_loss if noise_loss else cp2_loss * 1e9)
    C.report("bf16_cp2_vs_cp1_over_noise_floor_grads", cp2_grads / noise_grads if noise_grads else cp2_grads * 1e9)
    # same packing (micro-batch count): the loss differs by float32 rounding of its sums only
    C.report("bf16_cp2_vs_cp1_same_packing_loss", max(abs(bf[k][0] - cp1["bfloat16", k][0]) for k in bf))
    C.report("bf16_cp2_vs_cp1_same_packing_grads", max(worst(bf[k][1], cp1["bfloat16", k][1]) for k in bf))
    fp32 = want["ppo"]
    C.report("bf16_cp1_vs_fp32_loss", abs(base[0] - fp32[0]))
    C.report("bf16_cp1_vs_fp32_grads", worst(base[1], fp32[1]))
    C.report("bf16_cp2_vs_fp32_loss", max(abs(bf[k][0] - fp32[0]) for k in bf))
    C.report("bf16_cp2_vs_fp32_grads", max(worst(bf[k][1], fp32[1]) for k in bf))

    for k in (1, 3):   # distillation: the teacher under the student's CP layout, its KL gathered over CP
        loss, grads, kl, sampled = distill(params0, batch, teacher_params, k)
        C.report(f"distill_cp2_mb{k}_loss", abs(loss - cp1_distill[0]))
        C.report(f"distill_cp2_mb{k}_grads", worst(grads, cp1_distill[1]))
        C.report(f"distill_cp2_mb{k}_kl", abs(kl - cp1_distill[2]))
    C.check("teacher log-probs", sampled, cp1_distill[3], tol=1e-4)
    C.report("distill_cp2_sampled_logprobs_rel", ((sampled - cp1_distill[3]).abs().max() / cp1_distill[3].abs().max()).item())

    eng = trainer(params0)   # GRPO updates at CP2, a checkpoint after the first
    first = eng.train_mini_batch(g_batch, PPO, micro_batch_tokens=16)
    checkpoint.save(root, 1, chunks=eng.chunks, optimizer=eng.optimizer, scheduler=eng.scheduler)
    second = eng.train_mini_batch(g_batch, PPO, micro_batch_tokens=16)
    cp2_params = params_of(eng)
    assert second["micro_batches"] > 1, second
    for what in ("loss", "grad_norm"):
        C.report(f"grpo_cp2_vs_cp1_{what}", max(abs(m[what] - w[what]) for m, w in zip((first, second), cp1_steps)))
    C.report("grpo_cp2_vs_cp1_params", worst(cp2_params, cp1_params))
    C.down()

    C.up(seed=999, tensor=1)   # resume at CP1 (DP = 2, each rank the whole batch), another initialisation
    eng = trainer(None)
    got = checkpoint.load(root, chunks=eng.chunks, optimizer=eng.optimizer, scheduler=eng.scheduler)
    assert got.step == 1 and eng.scheduler.num_steps == 1, (got.step, eng.scheduler.num_steps)
    res = eng.train_mini_batch(g_batch, PPO, micro_batch_tokens=32)
    for what in ("loss", "grad_norm", "lr"):
        C.report(f"resume_cp2_to_cp1_{what}", abs(res[what] - second[what]))
    C.report("resume_cp2_to_cp1_params", worst(params_of(eng), cp2_params))
    C.down()


if __name__ == "__main__":
    C.main_guard(lambda: main(Path(sys.argv[1])))
