"""One router over every engine group (`rollout.mode = "server"`, `rollout.router = "driver"`).

With `rollout.router = "leader"` (the default) each generating leader runs its own shards'
trajectories on its own engine. With "driver" one rank, the driver, runs every data-parallel
shard's trajectories and its `Router` spreads them over all leaders' engines (least outstanding
work, sticky per trajectory), so a long trajectory on one engine group no longer idles the others
while a step waits for it:

- the driver: colocated, world rank 0 (its model-parallel group produces with it, as a leader's
  group does); separate, the first rollout rank;
- every other leader serves its engine on its own event loop (`mrl.rollout.remote.EngineServer`:
  submit, abort, pause, resume over HTTP) and the driver reaches it through a `RemoteEngine`;
  token ids, log-probs and finish reasons cross the channel exactly;
- weights, sleep and wake stay with each leader, as with one router per leader (the colocated
  channel or the separate bridge loads each engine in its own process); the driver starts a step
  only once every leader has loaded its weights, and ends it only when every trajectory it started
  has returned, so no request runs on weights of another version;
- the driver's producer holds every shard's sampler and carried groups (so they are in its
  checkpoint), produces the step (`mrl.train.produce`, every shard on this rank) and the others
  wait for it (`wait_for_peers`, whose timeout covers a leader's work); colocated, each rank then
  takes its shard of the broadcast result; separate, the driver sends the step to the trainer.
"""
from __future__ import annotations

import os
import secrets
from typing import Optional

from mrl.platform.collectives import broadcast_object, gather_objects
from mrl.platform.dist import wait_for_peers, waits_within


def driver_routes(spec) -> bool:
    """Whether one router on the driver spreads every shard over every leader's engine."""
    return spec.rollout.mode == "server" and spec.rollout.router == "driver"


def driver_problems(spec) -> list[tuple[str, str]]:
    """(key, message) for what `rollout.router = "driver"` cannot do (`mrl validate`, `mrl train`)."""
    from mrl.reward.sources import reward_sources

    if not driver_routes(spec):   # without server mode: refused with the other server-mode keys (layout.py)
        return []
    if any(s.kind == "model" for s in reward_sources(spec.reward, check_files=False)):
        return [("rollout.router", "'driver' scores every shard on the driver, but a reward model (reward.model_path) "
                                   "runs on every rank of each model-parallel group; use rollout.router = 'leader'")]
    return []


def produces(spec, ctx, gen) -> bool:
    """Whether this rank runs the producer: every generating rank with one router per leader; with a
    driver, the driver's group only (colocated: the ranks whose leader is rank 0; separate: the
    first rollout rank)."""
    if not driver_routes(spec):
        return True
    if ctx.role == "rollout":
        return ctx.rank == 0
    return gen.leader == 0


def shards_of(spec, plan, ctx, leader: int) -> list[int]:
    """The data-parallel shards whose prompts this rank samples (`leader`: the global rank of its
    colocated model-parallel leader): its own (colocated) or its engine group's (separate); every
    shard on the driver's ranks with `rollout.router = "driver"`."""
    if driver_routes(spec) and (ctx.rank == 0 if ctx.role == "rollout" else leader == 0):
        return list(range(plan.dp))
    if plan.separate:
        return plan.shards_of_group(plan.engine_group_of(ctx.rank))
    return [ctx.dp_rank]


def connect_leaders(spec, ctx, gen) -> Optional[str]:
    """Collective over the generating world: every leader but the driver serves its engine; the
    driver's router adds them all. A line for the startup log (None on ranks that say nothing)."""
    from mrl.rollout.remote import RemoteEngine, reachable_host

    if not driver_routes(spec):
        return None
    driver = ctx.rank == 0
    token = broadcast_object(secrets.token_hex(16) if driver else None, "router channel token")
    url = None
    if gen.is_leader and not driver:
        host = "127.0.0.1" if spec.platform.nodes == 1 else "0.0.0.0"
        advertise = reachable_host(os.environ.get("MASTER_ADDR")) if spec.platform.nodes > 1 else None
        url = gen.generator.serve(token, host=host, advertise=advertise)
    urls = gather_objects((ctx.global_rank, url, gen.leader), "router channel addresses")
    # the producer's waits (`from_leader`) are the driver group's: the ranks whose leader is the driver
    group = [i for i, (_, _, leader) in enumerate(urls) if leader == urls[0][2]]
    if len(group) > 1:   # every rank creates it; its timeout is the wait group's (a leader's work)
        import datetime

        import torch.distributed as dist

        from mrl.platform.dist import wait_timeout_s

        made = dist.new_group(group, backend="gloo", timeout=datetime.timedelta(seconds=wait_timeout_s()))
        gen.driver_group = made if ctx.rank in group else None
    if not driver:
        return f"router: rank {ctx.global_rank} serves its engine at {url}" if url else None
    remotes = [RemoteEngine(u, token, f"the engine of rank {r}", timeout_s=spec.rollout.generate_timeout_s)
               for r, u, _ in urls if u is not None]
    gen.generator.route_to(remotes)
    return f"router: one router on rank {ctx.global_rank} over {1 + len(remotes)} engine groups"


def driven_step(run, gen, prompts, step: int, reward_model=None):
    """Step `step`'s rollouts (`produce.StepRollout`) with a driver (see the module docstring): the
    driver's group produces every shard, the other ranks wait for it; colocated, every rank gets
    the result (and takes the driver's data position and groups in hand, so every rank saves the
    same state); separate, only the driver holds it (None elsewhere)."""
    from mrl.train.produce import produce

    mine = produces(run.spec, run.ctx, gen)
    # every leader has loaded the step's weights before the driver sends it a request (each loads
    # its own, in its own time: without this a remote engine can serve the first requests with the
    # weights it held before)
    wait_for_peers("every leader's weights before the driver's rollouts")
    rollout = None
    if mine:
        with waits_within(gen.driver_group):   # the driver group's waits; the other ranks wait below
            rollout = produce(run, gen, prompts, step, None, reward_model=reward_model)
    wait_for_peers("the driver's rollouts")
    if run.ctx.role == "rollout":
        return rollout
    rollout = broadcast_object(rollout, "the driver's rollouts")
    if not mine:   # every rank holds the driver's data position and groups in hand (its checkpoint state)
        from mrl.train.carry import decode_carry

        prompts.load_position(rollout.position)
        prompts.carry = decode_carry(rollout.carry, prompts.dataset)
    return rollout
