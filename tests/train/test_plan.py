"""The step plan (`mrl.train.plan`): counts resolved once, and a plan that does not divide is an
error at validate time, never rounded; the metric kinds and the collectives on one rank."""
from __future__ import annotations

import pytest
import torch

from mrl.config.loader import load
from mrl.errors import SpecError

QUICKSTART = "jobs/quickstart_cpu.toml"


def test_the_quickstart_plan():
    from mrl.train.plan import step_plan

    spec, _ = load(QUICKSTART)
    plan = step_plan(spec)
    assert (plan.world, plan.trainer_world, plan.dp) == (2, 2, 1)          # TP 2
    assert (plan.prompts_per_step, plan.prompts_per_rank, plan.responses_per_rank) == (8, 8, 64)
    assert (plan.actor.prompts, plan.actor.prompts_per_rank, plan.actor.mini_batches) == (4, 4, 2)
    assert plan.actor.optimizer_steps == 2 and plan.critic is None and not plan.separate


def test_a_separate_plan_names_engine_groups_and_their_shards():
    from mrl.train.plan import step_plan

    spec, _ = load(QUICKSTART, ["platform.ranks_per_node=5", "parallel.tensor=1", "rollout.placement=separate",
                                "rollout.ranks=2", "rollout.max_staleness=1", "actor.mini_batch_prompts=3",
                                "data.prompts_per_step=6"])
    plan = step_plan(spec)
    assert (plan.trainer_world, plan.engine_world, plan.dp, plan.engine_groups) == (3, 2, 3, 2)
    assert [plan.shards_of_group(g) for g in range(2)] == [[0, 2], [1]]
    assert plan.engine_leader_of(1) == 1 and plan.engine_group_of(1) == 1
    assert (plan.actor.prompts_per_rank, plan.actor.mini_batches) == (1, 2)


@pytest.mark.parametrize("patch,key,fragment", [
    (["parallel.tensor=1", "data.prompts_per_step=7", "actor.mini_batch_prompts=7"], "data.prompts_per_step",
     "7 prompts do not split evenly over data-parallel size 2"),
    # 2 prompts x 8 responses split over DP 4 by responses, but not by whole prompts: formerly
    # silently lowered at run time
    (["platform.ranks_per_node=4", "parallel.tensor=1", "actor.mini_batch_prompts=2"], "actor.mini_batch_prompts",
     "2 prompts per mini-batch do not split evenly over data-parallel size 4"),
])
def test_a_plan_that_does_not_divide_is_a_validate_error(patch, key, fragment):
    with pytest.raises(SpecError) as e:
        load(QUICKSTART, patch)
    assert any(f"{key}: " in p and fragment in p for p in e.value.problems), e.value.problems


def test_fewer_kept_prompts_than_planned_train_in_whole_mini_batches():
    """`dynamic_sampling.on_exhausted = "proceed"`: a rank that kept fewer prompts than the plan
    splits them into the most whole mini-batches it can (never more than planned)."""
    from mrl.train.plan import Updates

    u = Updates(prompts=4, prompts_per_rank=2, mini_batches=4, epochs=1)
    assert [u.mini_batches_of(k) for k in (8, 7, 6, 5, 4, 1)] == [4, 1, 3, 1, 2, 1]


def test_metric_kinds_and_their_combination_over_ranks():
    from mrl.train.metrics import RewardStats, combine, kind

    assert [kind(k) for k in ("reward/errors", "tools/calls", "time/step", "actor/grad_norm_max", "memory/x",
                              "reward/mean")] == ["sum", "sum", "max", "max", "max", "mean"]
    ranks = [{"reward/errors": 1.0, "tools/calls": 5.0, "time/step": 2.0, "reward/mean": 1.0},
             {"reward/errors": 3.0, "tools/calls": 2.0, "time/step": 5.0, "reward/mean": float("nan")}]
    assert combine(ranks, dp=2) == {"reward/errors": 4.0, "tools/calls": 7.0, "time/step": 5.0, "reward/mean": 1.0}
    acc = RewardStats()
    acc.add({"reward/mean": 1.0, "reward/errors": 1.0, "time/reward_scoring": 0.5}, responses=2)
    acc.add({"reward/mean": 4.0, "reward/errors": 2.0, "time/reward_scoring": 0.5}, responses=6)
    assert acc.result() == {"reward/errors": 3.0, "time/reward_scoring": 1.0, "reward/mean": (2 + 24) / 8}


def test_collectives_on_one_rank_are_the_identity():
    from mrl.platform import collectives as c

    t = torch.tensor([1.0, 2.0])
    assert c.dp_sum(t).tolist() == [1.0, 2.0] and c.dp_min(3) == 3 and c.world_min(4, "x") == 4
    assert c.world_max(2.5, "x") == 2.5 and c.broadcast_object({"a": 1}, "x") == {"a": 1}
    assert c.gather_objects(5, "x") == [5] and c.from_leader(6, None, True, "leader work") == 6


def test_keep_groups_of_is_the_one_keep_drop_rule():
    from mrl.train.produce import keep_groups_of

    scored = {"scores": [1, 0, 1, 1, 0, 1], "filter_values": [1, 0, 1, 1, 0, 1], "valid": [True] * 4 + [False, True]}
    assert keep_groups_of(scored, 2, dynamic_sampling=True, drop_invalid=False) == ([True, False, True], 0)
    assert keep_groups_of(scored, 2, dynamic_sampling=True, drop_invalid=True) == ([True, False, False], 2)
    assert keep_groups_of(scored, 2, dynamic_sampling=False, drop_invalid=False) == ([True, True, True], 0)
