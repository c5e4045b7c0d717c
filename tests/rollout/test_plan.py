"""The prompt plan (which engine group generates which prompts, where responses go back) and the
rollout layout rules shared by `mrl validate` and `mrl train`."""
from __future__ import annotations

import itertools

import pytest

from mrl.rollout.plan import EngineGroups, PromptPlan, plan_prompts


def test_engine_groups_are_consecutive_ranks():
    g = EngineGroups(world_size=8, ranks_per_engine=2)
    assert g.count == 4
    assert [g.group_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert list(g.ranks(2)) == [4, 5] and g.leader(3) == 6
    with pytest.raises(ValueError, match="do not divide"):
        EngineGroups(world_size=6, ranks_per_engine=4)


def test_trainer_tp2_feeding_two_tp1_engines():
    # one DP rank (trainer TP2 on 2 ranks) with 4 prompts; two engine groups of one rank each
    plan = plan_prompts([[8] * 4], groups=2)
    assert plan.shares == (((0, 0), (0, 1)), ((0, 2), (0, 3)))
    assert plan.routes(0) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_trainer_dp2_feeding_one_tp2_engine():
    plan = plan_prompts([[8] * 2, [8] * 2], groups=1)
    assert plan.shares == (((0, 0), (0, 1), (1, 0), (1, 1)),)
    assert plan.routes(0) == [(0, 0), (0, 1)] and plan.routes(1) == [(0, 2), (0, 3)]


def test_one_engine_per_dp_rank_is_the_identity():
    plan = plan_prompts([[4] * 3] * 4, groups=4)
    for dp in range(4):
        assert plan.shares[dp] == tuple((dp, i) for i in range(3))
        assert plan.routes(dp) == [(dp, i) for i in range(3)]


def _check(plan: PromptPlan, counts, groups):
    # every prompt is generated exactly once, shares are contiguous in DP order, routes invert shares
    flat = [ref for share in plan.shares for ref in share]
    assert flat == [(dp, i) for dp, c in enumerate(counts) for i in range(len(c))]
    for dp, c in enumerate(counts):
        routes = plan.routes(dp)
        assert len(routes) == len(c)
        for i, (g, pos) in enumerate(routes):
            assert plan.shares[g][pos] == (dp, i)
    loads = [plan.responses_of(g, counts) for g in range(groups)]
    assert sum(loads) == sum(map(sum, counts))
    # balanced by responses: no group exceeds the ideal by more than one prompt's responses
    biggest = max((w for c in counts for w in c), default=0)
    assert max(loads) <= sum(loads) / groups + biggest


@pytest.mark.parametrize("dp,per_rank,groups", list(itertools.product([1, 2, 3, 4], [0, 1, 2, 5], [1, 2, 3, 4, 8])))
def test_plan_invariants_equal_responses(dp, per_rank, groups):
    counts = [[4] * per_rank for _ in range(dp)]
    plan = plan_prompts(counts, groups)
    _check(plan, counts, groups)
    if per_rank * dp % groups == 0:   # an even split is exact
        assert len({len(s) for s in plan.shares}) == 1


def test_plan_balances_unequal_response_counts():
    counts = [[1, 1, 1, 1, 8], [1, 1, 1, 1]]
    plan = plan_prompts(counts, groups=2)
    _check(plan, counts, 2)
    assert [plan.responses_of(g, counts) for g in range(2)] == [4, 12]   # contiguous: 8 cannot be split


def test_fewer_prompts_than_groups_leaves_groups_idle():
    plan = plan_prompts([[2]], groups=3)
    assert sum(len(s) for s in plan.shares) == 1 and plan.routes(0)[0][1] == 0


# ---------------------------------------------------------------- layout rules (validate == train)

def _rollout(**kw):
    from mrl.rollout.config import RolloutConfig

    return RolloutConfig(**kw)


def _facts(heads=4, kv=2, experts=None):
    from mrl.models.facts import ModelFacts

    return ModelFacts(num_layers=2, num_attention_heads=heads, num_query_groups=kv, hidden_size=128, vocab_size=512,
                      num_experts=experts, source="test")


@pytest.mark.parametrize("kw,world,facts,key,fragment", [
    (dict(engine="hf", tensor_parallel=2), 2, None, "rollout.tensor_parallel", "'hf' engine does not shard"),
    (dict(engine="hf", expert_parallel=True), 2, None, "rollout.expert_parallel", "'hf' engine does not shard"),
    (dict(engine="vllm", tensor_parallel=4), 2, None, "rollout.tensor_parallel", "does not divide the world size 2"),
    (dict(engine="vllm", tensor_parallel=3), 3, _facts(), "rollout.tensor_parallel", "3 does not divide the 4 attention heads"),
    (dict(engine="vllm", tensor_parallel=4), 4, _facts(heads=12, kv=6), "rollout.tensor_parallel", "KV heads"),
    (dict(engine="vllm", pipeline_parallel=2), 2, None, "rollout.pipeline_parallel", "tensor parallelism only"),
    (dict(engine="vllm", expert_parallel=True), 2, _facts(), "rollout.expert_parallel", "has no experts"),
])
def test_layout_rules(kw, world, facts, key, fragment):
    from mrl.rollout.layout import first_problem, rollout_layout_problems

    problems = rollout_layout_problems(_rollout(**kw), world, facts, "cuda")
    assert any(k == key and fragment in m for k, m in problems), problems
    assert "\n" not in first_problem(_rollout(**kw), world, facts)


def test_vllm_cpu_refuses_moe_models():
    from mrl.rollout.layout import rollout_layout_problems

    moe = _facts(experts=4)
    assert rollout_layout_problems(_rollout(engine="vllm"), 2, moe, "cuda") == []
    [(key, message)] = rollout_layout_problems(_rollout(engine="vllm"), 2, moe, "cpu")
    assert key == "rollout.engine" and "vllm-cpu cannot" in message
    assert rollout_layout_problems(_rollout(engine="hf"), 2, moe, "cpu") == []


@pytest.mark.parametrize("kw,world,facts", [
    (dict(engine="hf"), 2, _facts()),
    (dict(engine="vllm", tensor_parallel=2), 2, _facts()),
    (dict(engine="vllm", tensor_parallel=1), 2, _facts()),
    (dict(engine="vllm", tensor_parallel=4), 8, _facts(heads=28, kv=4)),            # Qwen2.5-7B, TP4
    (dict(engine="vllm", tensor_parallel=8), 8, _facts(heads=32, kv=4)),            # KV heads replicated
    (dict(engine="vllm", tensor_parallel=4, expert_parallel=True), 16, _facts(heads=32, kv=4, experts=128)),
])
def test_layouts_that_start(kw, world, facts):
    from mrl.rollout.layout import rollout_layout_problems

    assert rollout_layout_problems(_rollout(**kw), world, facts) == []
