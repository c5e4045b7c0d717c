"""MoE through the engine: `tiny-qwen3-moe` (routed experts, QK-norm, load-balancing aux loss) at
EP=2 equals EP=1 (2 data-parallel ranks both times, the same batch split): loss, gradient norm
and the updated weights. At EP=2 each rank holds half of the experts and tokens cross ranks in
the alltoall dispatcher. (MoE with TP needs sequence parallelism, which the cpu platform refuses.)"""
import re

import torch

import _engine_common as E
from _engine_common import C

from mrl.engine import Engine
from mrl.engine.objectives import PolicyObjective
from mrl.models.facts import BUILTIN_PRESETS
from mrl.models.megatron import complete_hf_config, parallel_from_state
from mrl.models.roles import build_role_model

HF = complete_hf_config(dict(BUILTIN_PRESETS["tiny-qwen3-moe"]))
OBJ = PolicyObjective(loss="ppo", eps_low=0.2, eps_high=0.28, clip_c=3.0)
EXPERT = re.compile(r"(.*\.local_experts\.)(\d+)(\..*)")
TOL = 1e-6


def actor():
    return build_role_model("actor", HF, parallel_from_state(), dtype="float32", device="cpu")


def engine(model) -> Engine:
    from mrl.optim import build_optimizer, build_scheduler, wrap_ddp
    from mrl.optim.config import OptimConfig, ScheduleConfig

    ddp = wrap_ddp([model], distributed_optimizer=False)
    optim = OptimConfig(lr=1e-3, eps=1e-4)
    opt = build_optimizer(ddp, optim, distributed_optimizer=False)
    return Engine(ddp, optimizer=opt, scheduler=build_scheduler(opt, optim, ScheduleConfig(), 10))


def main():
    assert HF["router_aux_loss_coef"] > 0 and HF["num_local_experts"] == 4
    ctx = C.up(expert=1)  # DP = 2
    torch.manual_seed(31)
    model = actor()
    C.perturb_(model, seed=32)
    params1 = C.full_params(model)
    assert any(EXPERT.match(n) for n in params1), "the MoE model has expert parameters"
    batch = E.with_old_logprobs(model, E.synthetic_batch(prompts=4, per_prompt=2))
    mine = batch.dp_shard(ctx.dp_rank, ctx.dp)
    budget = E.budget_for([batch.dp_shard(r, 2).sequence_lengths.tolist() for r in range(2)], 2)
    eng = engine(model)
    want = eng.train_mini_batch(mine, OBJ, micro_batch_tokens=budget)
    assert want["micro_batches"] == 2 and want["updated"] == 1.0, want
    after1 = {n: p.detach().clone() for n, p in eng.chunks[0].module.named_parameters()}
    C.down()

    ctx = C.up(expert=2)  # DP = 2, each rank half of the experts
    assert ctx.layout.ep == 2
    ep_rank, per_rank = ctx.layout.ep_rank, HF["num_local_experts"] // 2

    def global_name(name):
        m = EXPERT.match(name)
        return f"{m.group(1)}{int(m.group(2)) + ep_rank * per_rank}{m.group(3)}" if m else name

    model = actor()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params1[global_name(n)])
    eng = engine(model)
    got = eng.train_mini_batch(mine, OBJ, micro_batch_tokens=budget)
    C.report("moe_ep2_loss", abs(got["loss"] - want["loss"]))
    C.report("moe_ep2_grad_norm", abs(got["grad_norm"] - want["grad_norm"]) / want["grad_norm"])
    worst = max(C.check(f"param {global_name(n)} after the update", p, after1[global_name(n)], tol=TOL)
                for n, p in eng.chunks[0].module.named_parameters())
    C.report("moe_ep2_params", worst)
    C.down()


if __name__ == "__main__":
    C.main_guard(main)
