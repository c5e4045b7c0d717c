"""The rollout ranks' loop, separate placement (the producer side of `mrl.train.separate`): take
the start, then for each step take the weights it needs (`mrl.train.wire`: checked, full or delta,
loaded into this rank's engine), produce its rollouts
(`mrl.train.produce`) and send them to trainer rank 0; validate the versions the trainer asks for.
"""
from __future__ import annotations

import time
from typing import Optional

from mrl.platform.bridge import Bridge
from mrl.platform.collectives import broadcast_object, gather_objects, world_min
from mrl.platform.dist import wait_for_peers
from mrl.train.carry import merge_carries, restore_shards
from mrl.train.driver import driven_step, driver_routes
from mrl.train.evaluate import ValidationResult, evaluate
from mrl.train.liveness import Heartbeat
from mrl.train.parts import Generation, Prompts, Run, SampleLog
from mrl.train.produce import produce
from mrl.train.separate import Start, needed_version, versions_sent
from mrl.train.wire import BridgeReceiver


def agree_min(count: int) -> int:
    """The producer's `agree_min` on the rollout ranks: the minimum over them."""
    return world_min(count, "rollout agreement")


def serve(run: Run, gen: Generation, prompts: Prompts) -> None:
    """The rollout ranks' loop (separate placement): take the start, then for each step take the
    weights it needs, produce its rollouts and send them to trainer rank 0."""
    bridge: Bridge = run.ctx.bridge
    heartbeat = Heartbeat(bridge.store, bridge.rank)
    weights = BridgeReceiver(bridge, gen.engine, group=f"{run.plan.engine_group_of(run.ctx.rank)} "
                                                      f"(rollout rank {run.ctx.rank})")
    try:
        start: Optional[Start] = None
        if bridge.rank == bridge.rollout_leader:
            start = bridge.recv_object(0, "rollout start")
        wait_for_peers("rollout start")
        start = broadcast_object(start, "rollout start")
        restore_shards(prompts, start.position, start.carry)
        k = run.spec.rollout.max_staleness
        pending = versions_sent(start.first_step, start.last_step, k, start.start_version, start.validated)
        sent = 0
        leader = bridge.rank == bridge.rollout_leader

        def send(message, what: str) -> None:
            nonlocal sent
            if leader:
                sent += 1
                heartbeat.announce(sent)
                bridge.send_object(message, 0, what)

        def take_version() -> None:
            """Load the next version trainer rank 0 sends, and validate it when asked to."""
            heartbeat.wait_for_weights(pending[0])
            version = weights.receive(pending.pop(0))
            gen.version = version
            if version in start.validated:
                send(_validate(run, gen, prompts, version), f"validation of step {version}")

        for step in range(start.first_step, start.last_step + 1):
            need = needed_version(step, k, start.start_version)
            while pending and pending[0] <= need:
                take_version()
            if driver_routes(run.spec):   # the driver produces every shard over every rollout rank's engine
                rollout = driven_step(run, gen, prompts, step)
            else:
                rollout = produce(run, gen, prompts, step, agree_min)
                # every engine group's shards, and groups in hand (the checkpoint's), to the rollout leader
                everyone = gather_objects((rollout.shards, rollout.carry) if gen.is_leader else ({}, None),
                                          "rollout shards to the rollout leader")
                rollout.shards = {d: s for part, _ in everyone for d, s in part.items()}
                rollout.carry = merge_carries([c for _, c in everyone]) if rollout.carry is not None else None
            send(rollout, f"rollouts of step {step}")
        while pending:   # versions sent only to be validated (the last steps')
            take_version()
    finally:
        heartbeat.stop()


def _validate(run: Run, gen: Generation, prompts: Prompts, version: int) -> ValidationResult:
    """Validate the policy the rollout ranks hold (version `version`)."""
    started = time.perf_counter()
    samples = SampleLog()
    metrics = evaluate(run, gen, prompts, version, samples)
    metrics["time/validation"] = time.perf_counter() - started
    return ValidationResult(version, metrics, samples.take("validation"))
