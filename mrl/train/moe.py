"""Mixture-of-experts stages of a training step: routing replay (`actor.moe.routing_replay`) and
the `moe/*` metrics. The mechanism is `mrl.engine.routing`; this module says which routes each
actor pass replays and what a step reports.

- "off": every pass routes by itself.
- "r2": the old-log-prob pass records its own routes (`trainer_*_routes`) and the update passes
  replay them, so the ratio compares the same experts. An on-policy step has no separate
  old-log-prob pass (the update's forward gives the old log-probs): nothing to replay there.
- "r3": every actor pass (old log-probs and updates) replays the routes the rollout engine chose
  (`rollout_*_routes`, from `Response.routes`: the hf engine's router outputs, or vLLM's
  routed-experts output, `enable_return_routed_experts`), prompt tokens included.
The reference model is not replayed: the KL is to the reference as it routes by itself.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from mrl.batch import Batch

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


def rollout_routes(responses, prompts: list[list[int]], batch: Batch) -> dict[str, torch.Tensor]:
    """`rollout_prompt_routes [B, P, L, k]` (left-padded) and `rollout_response_routes [B, R, L, k]`
    (right-padded) from each response's `routes` (`[prompt + response tokens, L, k]`), -1 at
    padding; `{}` when a response has none (a dense model, an engine that does not return them)."""
    if not responses or any(r.routes is None for r in responses):
        return {}
    L, k = responses[0].routes.shape[1:]
    P, R = batch["prompt_ids"].shape[1], batch.response_width
    prompt = torch.full((len(responses), P, L, k), -1, dtype=responses[0].routes.dtype)
    response = torch.full((len(responses), R, L, k), -1, dtype=responses[0].routes.dtype)
    for i, (r, p) in enumerate(zip(responses, prompts)):
        if r.routes.shape[0] != len(p) + len(r.token_ids):
            raise RuntimeError(f"response {i}: routes for {r.routes.shape[0]} tokens, but prompt + response "
                               f"have {len(p) + len(r.token_ids)}")
        prompt[i, P - len(p):] = r.routes[:len(p)]
        response[i, :len(r.token_ids)] = r.routes[len(p):]
    return {"rollout_prompt_routes": prompt, "rollout_response_routes": response}


def begin_step(actor) -> None:
    if actor.routing is not None:
        actor.routing.reset()


@contextlib.contextmanager
def actor_pass(actor, mode: str, which: str, batch: Batch):
    """Inside: the actor's passes replay what `mode` says for `which` ("old": the old-log-prob
    pass, which records under r2; "update": the update passes)."""
    hooks = actor.routing
    if hooks is None or mode == "off":
        yield
        return
    source: Optional[str] = None
    if mode == "r3":
        if "rollout_prompt_routes" not in batch:
            raise RuntimeError("actor.moe.routing_replay = 'r3', but the rollout returned no routes")
        source = "rollout"
    elif which == "update" and "trainer_prompt_routes" in batch:
        source = "trainer"
    hooks.replay_from, hooks.record = source, (mode == "r2" and which == "old")
    try:
        yield
    finally:
        hooks.replay_from, hooks.record = None, False


def recorded(actor, mode: str, batch: Batch) -> Batch:
    """R2: the batch with the routes the old-log-prob pass recorded."""
    if actor.routing is None or mode != "r2":
        return batch
    return batch.add(**actor.routing.take_recorded(batch))


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
