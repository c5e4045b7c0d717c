"""Mixture-of-experts: routing replay's modes (`actor.moe.routing_replay`) and what a job needs
for them, the replay hooks on an MoE actor, and the `moe/*` metrics a step reports (its last
stage). The mechanism is `mrl.engine.routing`; where the routes travel:

- the rollout's routes enter the batch with the step's rollouts (`mrl.train.batching`:
  `rollout_*_routes`, from `Response.routes`: the hf engine's router outputs, or vLLM's
  routed-experts output, `enable_return_routed_experts`), prompt tokens included;
- the actor passes of the step apply them (`mrl.train.step.actor_pass`, `recorded_routes`):
  - "off": every pass routes by itself;
  - "r2": the old-log-prob pass records its own routes (`trainer_*_routes`) and the update passes
    replay them, so the ratio compares the same experts. An on-policy step has no separate
    old-log-prob pass (the update's forward gives the old log-probs): nothing to replay there;
  - "r3": every actor pass (old log-probs and updates) replays the rollout's routes.
The reference model is not replayed: the KL is to the reference as it routes by itself.
"""
from __future__ import annotations

import torch

REPLAY_MODES = ("off", "r2", "r3")


def replay_problems(spec, facts) -> list[tuple[str, str]]:
    """`(key, message)` for a `actor.moe.routing_replay` the job cannot run (`mrl validate`)."""
    mode = spec.actor.moe.routing_replay
    if mode == "off":
        return []
    key = "actor.moe.routing_replay"
    out = []
    if facts is not None and not facts.num_experts:
        out.append((key, f"is {mode!r} but {spec.model.path} has no experts (routing replay is for MoE models)"))
    if spec.actor.recompute == "full":
        out.append((key, f"{mode!r} cannot run with actor.recompute = 'full' (the recomputed forward would route "
                         "again); use 'selective' or 'none'"))
    if mode == "r3" and spec.rollout.engine == "vllm" and spec.platform.device == "cpu":
        out.append((key, "'r3' with rollout.engine = 'vllm' needs vLLM's routed-experts output, which vLLM 0.32 "
                         "computes only in its V2 model runner (Triton, GPU); on cpu use the hf engine"))
    return out


def attach(actor, hf: dict) -> None:
    """Replay hooks on an MoE actor's routers (no-op for a dense model)."""
    experts = hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts")
    if experts:
        actor.attach_routing()


def step_metrics(actor) -> dict[str, float]:
    """`moe/*` of a step (equal on every trainer rank; a collective over the trainer world):
    agreement of the trainer's own top-k with the rollout's on the step's first actor pass (the
    weights that generated the batch), expert load of that pass, and the router's auxiliary loss
    of the updates."""
    hooks = actor.routing
    if hooks is None:
        return {}
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    from mrl.engine.routing import load_ratio
    from mrl.platform.collectives import world_reduce

    stats = hooks.first_pass_stats or hooks.empty_stats()
    aux = sum(float(v["values"].sum()) for v in get_moe_layer_wise_logging_tracker().values())
    clear_aux_losses_tracker()
    calls = hooks.take_train_calls()
    from megatron.core import parallel_state as ps

    # under context parallelism a rank's aux loss is its chunks' share (megatron's router counts the
    # experts' tokens over the CP group): the CP group's shares add up to the sequence's loss
    share = 1.0 / ps.get_context_parallel_world_size() if ps.model_parallel_is_initialized() else 1.0
    flat = torch.cat([stats.agree, stats.compared, stats.load.reshape(-1),
                      torch.tensor([aux / calls if calls else 0.0, share if calls else 0.0], dtype=torch.float64)])
    device = actor.device if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl" else "cpu"
    flat = world_reduce(flat.to(device), "moe metrics").cpu()
    L, E = len(hooks.layers), hooks.experts
    agree, compared, load = flat[:L], flat[L:2 * L], flat[2 * L:2 * L + L * E].reshape(L, E)
    aux_sum, aux_ranks = flat[-2:].tolist()
    out: dict[str, float] = {}
    if float(compared.sum()) > 0:
        share = agree / compared.clamp(min=1)
        out.update({"moe/routing_agreement": float(share.mean()), "moe/routing_agreement_min": float(share.min())})
    if float(load.sum()) > 0:
        ratio = load_ratio(load)
        out.update({"moe/expert_load_max_over_mean": float(ratio.mean()),
                    "moe/expert_load_max_over_mean_max": float(ratio.max())})
    if aux_ranks:
        out["moe/router_aux_loss"] = aux_sum / aux_ranks
    return out
