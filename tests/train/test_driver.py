"""`mrl.train.driver`'s rules without a launch: who produces and which shards it samples with one
router on the driver (`rollout.router = "driver"`), `waits_within` scoping a rank's waits, and the
placement that needs the driver router. The two-process runs: `tests/train/test_driver_router.py`."""
from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from mrl.train.driver import driver_routes, produces, shards_of


def _spec(router="driver", mode="server"):
    return NS(rollout=NS(router=router, mode=mode))


PLAN = NS(dp=4, separate=False, shards_of_group=lambda g: [g, g + 2], engine_group_of=lambda r: r % 2)


def test_the_driver_group_samples_and_produces_every_shard():
    colocated = [NS(role="train", rank=r, global_rank=r, dp_rank=r // 2) for r in range(8)]   # TP 2 x DP 4
    leaders = [r - r % 2 for r in range(8)]
    assert [shards_of(_spec(), PLAN, c, leader) for c, leader in zip(colocated, leaders)] == \
        [[0, 1, 2, 3]] * 2 + [[1], [1], [2], [2], [3], [3]]
    assert [produces(_spec(), c, NS(leader=leader)) for c, leader in zip(colocated, leaders)] == [True] * 2 + [False] * 6
    # one router per leader: every rank its own shard, every rank produces
    assert [shards_of(_spec("leader"), PLAN, c, leader) for c, leader in zip(colocated, leaders)] == \
        [[0], [0], [1], [1], [2], [2], [3], [3]]
    assert all(produces(_spec("leader"), c, NS(leader=leader)) for c, leader in zip(colocated, leaders))
    separate = NS(**{**PLAN.__dict__, "separate": True})
    rollout = [NS(role="rollout", rank=r, global_rank=4 + r, dp_rank=0) for r in range(2)]
    assert [shards_of(_spec(), separate, c, 0) for c in rollout] == [[0, 1, 2, 3], [1, 3]]
    assert [produces(_spec(), c, NS(leader=c.global_rank)) for c in rollout] == [True, False]
    assert [shards_of(_spec("leader"), separate, c, 0) for c in rollout] == [[0, 2], [1, 3]]


def test_driver_routes_only_in_server_mode():
    assert driver_routes(_spec()) and not driver_routes(_spec("leader")) and not driver_routes(_spec(mode="spmd"))


def test_waits_within_scopes_and_restores():
    from mrl.platform import dist as mdist

    calls = []
    real = mdist.dist.barrier
    mdist.dist.barrier = lambda group=None: calls.append(group)
    try:
        with mdist.waits_within(None):   # the driver alone: nobody to wait for, even with a world
            mdist.wait_for_peers("alone")
            assert mdist._STATE.local.wait_within is None
        assert calls == [] and mdist._STATE.local.wait_within is mdist._EVERY_RANK
    finally:
        mdist.dist.barrier = real


def test_engine_groups_that_do_not_divide_the_shards_need_the_driver_router():
    """Separate placement, server mode: 2 rollout ranks (2 engine groups of 1 rank) for 1 trainer
    data-parallel shard leave one group without a shard under rollout.router = 'leader', and for 3
    shards one group has 2, the other 1 (the rounds do not line up: a rollout rank times out in
    the rollout agreement): `mrl validate` (the loader) and `mrl train` (the same
    `separate_problems`) refuse both, naming the keys and the driver router; the driver, and 2
    shards for 2 groups, pass."""
    from mrl.config.loader import load
    from mrl.errors import SpecError
    from mrl.train.placement import separate_problems

    job = "jobs/quickstart_async_cpu.toml"
    base = ["platform.ranks_per_node=3", "rollout.ranks=2", "parallel.tensor=1", "rollout.mode=server"]
    with pytest.raises(SpecError) as e:
        load(job, base)
    [problem] = [p for p in e.value.problems if "rollout.ranks: " in p]
    assert "2 engine groups for the trainer's 1 data-parallel shards, which they do not divide" in problem
    assert "rollout.router = 'driver'" in problem
    spec, _ = load(job, [*base, "rollout.router=driver"])
    assert separate_problems(spec) == []
    spec, _ = load(job, ["platform.ranks_per_node=4", "rollout.ranks=2", "parallel.tensor=1", "rollout.mode=server"])
    assert separate_problems(spec) == []
    with pytest.raises(SpecError, match="2 engine groups for the trainer's 3 data-parallel shards"):
        load(job, ["platform.ranks_per_node=5", "rollout.ranks=2", "parallel.tensor=1", "rollout.mode=server",
                   "data.prompts_per_step=6", "actor.mini_batch_prompts=3"])
