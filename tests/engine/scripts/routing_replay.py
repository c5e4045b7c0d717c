"""Routing replay through the engine (`mrl.engine.routing`) at EP1 (DP2), EP2, TP2 and PP2, in one
2-rank launch, on a tiny random `transformers` Qwen3-MoE loaded into megatron.

Per layout:
- off: the trainer's log-probs equal transformers'; its own top-k agrees with transformers' on
  every token (`agreement`);
- R3: replaying transformers' own routes changes nothing; replaying *random* routes gives the
  log-probs transformers computes when its routers are forced to those routes (the routes
  followed the tokens through the DP split, packing, the micro-batch split and the pipeline);
- R2: the routes recorded in a pass packed one way, replayed in a pass packed another way (more
  micro-batches), give the recorded pass's log-probs, and they are transformers' routes;
- training (EP1, EP2, PP2; MoE training at TP2 needs sequence parallelism, not on cpu): one
  update with R3 random routes has EP1's loss and gradient norm.
bf16 (EP2): a pass replaying the routes it recorded reproduces its log-probs bit for bit; against
transformers in bf16, R3 brings the MoE model's log-prob mismatch to a dense model's of the same
shape (and below its own without replay).
"""
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

import _engine_common as E
from _engine_common import C

from mrl.engine import Engine
from mrl.engine.objectives import PolicyObjective, actor_outputs
from mrl.models.megatron import complete_hf_config, parallel_from_state
from mrl.models.roles import build_role_model
from mrl.rollout.hf_routes import RouteCapture
from mrl.train.batching import rollout_routes
from mrl.weights import load_hf_checkpoint
from tests.weights.archs import make_hf_model

OBJ = PolicyObjective(loss="ppo", eps_low=0.2, eps_high=0.28, clip_c=3.0)
TOL = 2e-5


def sequences(batch):
    p_w = batch["prompt_ids"].shape[1]
    for i in range(len(batch)):
        p, r = int(batch.prompt_lengths[i]), int(batch["response_lengths"][i])
        yield i, p, r, torch.cat([batch["prompt_ids"][i, p_w - p:], batch["response_ids"][i, :r]])


def hf_pass(model, batch, forced=None):
    """transformers' per-token log-probs [B, R] and each sequence's routes ([S, L, k] list); with
    `forced` (a list of [S, L, k]), its routers use those experts (weights = softmax over all
    experts gathered there, renormalised: Qwen3-MoE's rule)."""
    lp = torch.zeros(len(batch), batch.response_width)
    routes, current = [], {}

    def force(layer):
        def hook(module, args, output):
            if "routes" not in current:
                return None
            logits = output[0]
            idx = current["routes"][:, layer].long()
            w = torch.softmax(logits.float(), -1).gather(1, idx)
            w = w / w.sum(-1, keepdim=True)
            return logits, w.to(logits.dtype), idx
        return hook

    cap = RouteCapture(model)
    handles = [r.register_forward_hook(force(i)) for i, r in enumerate(cap.routers)]
    try:
        with cap, torch.no_grad():
            for i, p, r, seq in sequences(batch):
                if forced is not None:
                    current["routes"] = forced[i]
                logits = model(input_ids=seq[None]).logits[0].float()
                routes.append(cap.take(1, len(seq))[0] if cap else None)   # None: a dense model
                lp[i, :r] = torch.log_softmax(logits[p - 1:p - 1 + r], -1).gather(1, seq[p:, None]).squeeze(1)
    finally:
        for h in handles:
            h.remove()
    return lp, routes


def with_routes(batch, routes):
    prompts = [seq[:p].tolist() for _, p, _, seq in sequences(batch)]
    resp = [SimpleNamespace(routes=rt, token_ids=seq[p:].tolist()) for rt, (_, p, _, seq) in zip(routes, sequences(batch))]
    return batch.add(**rollout_routes(resp, prompts, batch))


def build(hf, d, dtype, train):
    from mrl.optim import build_optimizer, build_scheduler, wrap_ddp
    from mrl.optim.config import OptimConfig, ScheduleConfig

    chunks = [build_role_model("actor", hf, parallel_from_state(), dtype=dtype, device="cpu")]
    load_hf_checkpoint(chunks, d, hf)
    if not train:
        return Engine(chunks, name="actor")
    ddp = wrap_ddp(chunks, distributed_optimizer=False)
    optim = OptimConfig(lr=1e-3, eps=1e-4)
    opt = build_optimizer(ddp, optim, distributed_optimizer=False)
    return Engine(ddp, optimizer=opt, scheduler=build_scheduler(opt, optim, ScheduleConfig(), 10))


def main():
    rank = int(os.environ["RANK"])
    d = Path(sys.argv[1]) / f"hf{rank}"
    model = make_hf_model("qwen3_moe", d, seed=3)   # the same weights on both ranks
    hf = complete_hf_config(json.loads((d / "config.json").read_text()))
    L, k, n_exp = hf["num_hidden_layers"], hf["num_experts_per_tok"], hf.get("num_experts") or hf["num_local_experts"]
    batch = E.synthetic_batch(prompts=4, per_prompt=2, seed=11)
    natural_lp, natural = hf_pass(model, batch)
    g = torch.Generator().manual_seed(5)
    forced = [torch.rand(len(rt), L, n_exp, generator=g).argsort(-1)[..., :k].sort(-1).values.to(torch.int16)
              for rt in natural]
    forced_lp, _ = hf_pass(model, batch, forced)
    assert (forced_lp - natural_lp).abs().max() > 1e-2, "the random routes change transformers' log-probs"
    b_nat, b_forced = with_routes(batch, natural), with_routes(batch, forced)
    b_forced = b_forced.add(old_logprobs=forced_lp + 0.3 * torch.randn(forced_lp.shape, generator=g))
    out_fn = actor_outputs(1.0, vocab_size=hf["vocab_size"], kernels="torch")
    trained = {}

    for name, sizes, train in (("ep1", {}, True), ("ep2", {"expert": 2}, True), ("tp2", {"tensor": 2}, False),
                               ("pp2", {"pipeline": 2}, True)):
        ctx = C.up(**sizes)
        eng = build(hf, d, "float32", train)
        hooks = eng.attach_routing()
        mine = lambda b: b.dp_shard(ctx.dp_rank, ctx.dp)   # noqa: E731
        rows = mine(batch.add(row=torch.arange(len(batch))))["row"]
        big = 10_000
        small = max(mine(batch).sequence_lengths.tolist())   # one response per micro-batch or so
        last = eng.last_stage

        def lp(b, budget=big, source=None):
            hooks.replay_from = source
            try:
                return eng.forward_only(mine(b), out_fn, micro_batch_tokens=budget)["logprobs"]
            finally:
                hooks.replay_from = None

        hooks.reset()
        off = lp(b_nat)
        s = hooks.first_pass_stats
        owned = s.compared > 0
        C.report(f"{name}_off_vs_hf", (off - natural_lp[rows]).abs().max() if last else 0.0)
        C.report(f"{name}_agreement_shortfall", float(1 - (s.agree[owned] / s.compared[owned]).min()))
        r3_natural, r3_forced = lp(b_nat, source="rollout"), lp(b_forced, small, "rollout")   # every stage runs them
        C.report(f"{name}_r3_natural_vs_off", (r3_natural - off).abs().max() if last else 0.0)
        C.report(f"{name}_r3_forced_vs_hf", (r3_forced - forced_lp[rows]).abs().max() if last else 0.0)

        hooks.record = True
        recorded_lp = lp(batch)
        hooks.record = False
        rec = hooks.take_recorded(mine(batch))
        mismatch = 0
        for j, row in enumerate(rows.tolist()):
            _, p, r, _ = list(sequences(batch))[row]
            mine_routes = torch.cat([rec["trainer_prompt_routes"][j, -p:], rec["trainer_response_routes"][j, :r]])
            layers = (mine_routes >= 0).all(0).all(-1)   # this stage's layers
            mismatch += int((mine_routes[:, layers] != natural[row][:, layers]).sum())
        C.report(f"{name}_r2_recorded_vs_hf_routes", float(mismatch))
        replayed = lp(batch.add(**_spread(rec, rows, len(batch))), small, "trainer")
        C.report(f"{name}_r2_replayed_vs_recorded", (replayed - recorded_lp).abs().max() if last else 0.0)

        if train:
            hooks.replay_from = "rollout"
            m = eng.train_mini_batch(mine(b_forced), OBJ, micro_batch_tokens=small)
            hooks.replay_from = None
            trained.setdefault("ep1", m)
            ref = trained["ep1"]
            C.report(f"{name}_r3_train_loss_vs_ep1", abs(m["loss"] - ref["loss"]))
            C.report(f"{name}_r3_train_grad_norm_vs_ep1", abs(m["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"])
        C.down()

    ctx = C.up(expert=2)   # bf16: replaying a pass's own routes reproduces it bit for bit
    eng = build(hf, d, "bfloat16", False)
    hooks = eng.attach_routing()
    mine = batch.dp_shard(ctx.dp_rank, ctx.dp)
    hooks.record = True
    own = eng.forward_only(mine, out_fn, micro_batch_tokens=10_000)["logprobs"]
    hooks.record = False
    hooks.replay_from = "trainer"
    again = eng.forward_only(mine.add(**hooks.take_recorded(mine)), out_fn, micro_batch_tokens=10_000)["logprobs"]
    C.report("bf16_ep2_r2_replayed_vs_recorded", (again - own).abs().max())
    hooks.replay_from = None

    # bf16 train/rollout mismatch (trainer vs transformers in bf16, mean |d log p| over the batch):
    # R3 brings the MoE model to the level of a dense model of the same shape, and below its own
    # level without replay (same seeds, so the figures are fixed on a machine)
    hf16 = model.to(torch.bfloat16)
    batch = E.synthetic_batch(prompts=24, per_prompt=2, seed=12)   # more tokens: a steadier mean
    lp16, routes16 = hf_pass(hf16, batch)
    b16 = with_routes(batch, routes16)
    rows = batch.add(row=torch.arange(len(batch))).dp_shard(ctx.dp_rank, ctx.dp)["row"]
    moe_off = eng.forward_only(b16.dp_shard(ctx.dp_rank, ctx.dp), out_fn, micro_batch_tokens=10_000)["logprobs"]
    hooks.replay_from = "rollout"
    moe_r3 = eng.forward_only(b16.dp_shard(ctx.dp_rank, ctx.dp), out_fn, micro_batch_tokens=10_000)["logprobs"]
    hooks.replay_from = None
    C.down()
    dd = Path(sys.argv[1]) / f"dense{rank}"
    dense_hf = make_hf_model("qwen3", dd, seed=3)
    dense_lp16, _ = hf_pass(dense_hf.to(torch.bfloat16), batch)
    ctx = C.up()
    dense_eng = build(complete_hf_config(json.loads((dd / "config.json").read_text())), dd, "bfloat16", False)
    dense = dense_eng.forward_only(batch.dp_shard(ctx.dp_rank, ctx.dp), out_fn, micro_batch_tokens=10_000)["logprobs"]
    mask = (batch["response_mask"][rows] > 0).double()

    def mean_diff(a, b):
        t = torch.stack([((a.double() - b.double()).abs() * mask).sum(), mask.sum()])
        torch.distributed.all_reduce(t)
        return float(t[0] / t[1])

    off16, r316, dense16 = mean_diff(moe_off, lp16[rows]), mean_diff(moe_r3, lp16[rows]), mean_diff(dense, dense_lp16[rows])
    if rank == 0:
        print(f"bf16 mean |dlogp| vs transformers: dense {dense16:.3e}, moe off {off16:.3e}, moe r3 {r316:.3e}", flush=True)
    C.report("bf16_r3_over_dense_mismatch", r316 / dense16)
    C.report("bf16_r3_over_off_mismatch", r316 / off16)
    C.down()


def _spread(rec, rows, n):
    """This rank's recorded routes placed at their rows of the whole batch (other rows -1): the
    pass replays `mine(batch)`, which selects them back."""
    out = {}
    for key, value in rec.items():
        full = torch.full((n, *value.shape[1:]), -1, dtype=value.dtype)
        full[rows] = value
        out[key] = full
    return out


if __name__ == "__main__":
    C.main_guard(main)
