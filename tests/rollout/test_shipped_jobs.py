"""Every shipped job, built as far as it goes without its hardware: spec, trainer layout, rollout
layout (the rule `mrl train` applies), engine groups, the step's prompt plan and each rank's
engine arguments. "validate ok" must mean "starts"."""
from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JOBS = sorted(p for p in (REPO / "jobs").glob("*.toml"))


def test_every_job_is_covered():
    names = {p.stem for p in JOBS}
    assert {"quickstart_cpu", "grpo_qwen2.5_7b", "ppo_qwen2.5_7b", "dapo_32b", "grpo_qwen3_30b_a3b"} <= names


@pytest.mark.parametrize("job", JOBS, ids=[p.stem for p in JOBS])
def test_shipped_job_builds_its_layout_and_engine_plan(job):
    from mrl.config.loader import load
    from mrl.models.facts import model_facts
    from mrl.platform.parallel import check_layout
    from mrl.rollout.layout import engine_world, rollout_layout_problems, trainer_world
    from mrl.rollout.plan import EngineGroups, plan_prompts
    from mrl.rollout.vllm_engine import engine_args

    spec, _ = load(job)
    if hasattr(spec, "sft"):   # an SFT job (mrl sft): no rollout engine
        check_layout(spec.parallel, spec.platform.world_size, spec.platform.device)
        return
    world = trainer_world(spec.rollout, spec.platform.world_size)     # the ranks that train
    check_layout(spec.parallel, world, spec.platform.device)           # megatron's rules
    facts = model_facts(spec.model.path)
    if facts is None:   # only a local checkpoint that is not on this machine may be unreadable
        assert "/" in spec.model.path and not spec.model.path.startswith(("Qwen/", "meta-llama/")), spec.model.path
    r = spec.rollout
    assert rollout_layout_problems(r, spec.platform.world_size, facts) == []   # mrl train's rule
    par = spec.parallel
    dp = world // (par.tensor * par.pipeline * par.context)
    per_dp = spec.data.prompts_per_step // dp
    assert per_dp * dp == spec.data.prompts_per_step
    if r.placement == "separate":   # engine group g of G generates DP shards g, g + G, ...
        groups = EngineGroups(engine_world(r, spec.platform.world_size), r.tensor_parallel * r.pipeline_parallel)
        shares = [list(range(g, dp, groups.count)) for g in range(groups.count)]
        assert all(shares), f"{job.name}: an engine group would idle ({shares})"
        return
    if r.engine != "vllm":
        return
    groups = EngineGroups(world, r.tensor_parallel * r.pipeline_parallel)
    plan = plan_prompts([[r.responses_per_prompt] * per_dp for _ in range(dp)], groups.count)
    loads = [plan.responses_of(g, [[r.responses_per_prompt] * per_dp] * dp) for g in range(groups.count)]
    assert min(loads) > 0, f"{job.name}: an engine group would idle ({loads})"
    assert max(loads) - min(loads) <= r.responses_per_prompt
    for d in range(dp):
        assert len(plan.routes(d)) == per_dp
    args = [engine_args(r, spec.model.path, seed=spec.job.seed, dtype=spec.model.dtype,
                        max_model_len=r.max_model_len, rank=rank, on_cpu=False) for rank in range(world)]
    for g in range(groups.count):
        seeds = {args[rank]["seed"] for rank in groups.ranks(g)}
        assert len(seeds) == 1, f"{job.name}: ranks of engine group {g} disagree on the seed"
        assert args[groups.leader(g)]["tensor_parallel"] == r.tensor_parallel
    assert len({a["seed"] for a in args}) == groups.count
    assert all(a["enable_expert_parallel"] == r.expert_parallel for a in args)
    if facts is not None and facts.num_experts:
        assert r.expert_parallel, f"{job.name}: an MoE recipe should shard experts in the engine"
