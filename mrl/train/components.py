"""Everything a run needs on this rank, built from a resolved job spec.

Models: the actor (trained, exported to the rollout engine every step), the reference (frozen,
when a KL term needs it), the critic (GAE) and a reward model (when `reward.model_path` is set).
Weights come from `model.path` (or the role's own path) through the weight-mapping layer; the
builtin presets start from megatron's seeded init, the reference and critic copying the actor's.

Rollout and rewards run once per model-parallel group, on its first rank (the group leader),
and their results are broadcast to the group, so every TP/PP rank trains on the same responses.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from mrl.config.job import JobSpec
from mrl.models.facts import builtin_preset

log = logging.getLogger(__name__)


@dataclass
class Components:
    spec: JobSpec
    ctx: Any
    hf: dict
    tokenizer: Any
    actor: Any                      # mrl.engine.Engine
    exporter: Any                   # mrl.weights.Exporter over the actor
    ref: Optional[Any] = None       # Engine without optimizer
    critic: Optional[Any] = None    # Engine
    rollout: Optional[Any] = None   # RolloutEngine: hf on the group leader (None elsewhere), vllm on every rank
    engine_groups: Optional[Any] = None  # mrl.rollout.plan.EngineGroups for vllm (None: hf on the leader)
    generator: Optional[Any] = None  # what generates: the engine, or a multi-turn tool loop over it
    rewarder: Optional[Any] = None  # mrl.reward.compose.Rewarder on the group leader
    reward_model: Optional[Any] = None  # Engine over a value-head model, on every rank
    rm_scores: Any = None               # PrecomputedScores handed to the rewarder
    dataset: Any = None
    sampler: Any = None
    total_steps: int = 0
    mp_group: Any = None
    mp_leader: int = 0              # global rank of this group's leader
    extras: dict = field(default_factory=dict)

    @property
    def is_leader(self) -> bool:
        return self.ctx.rank == self.mp_leader


def _has_weights(path: Optional[str]) -> bool:
    return bool(path) and builtin_preset(path) is None and Path(path).is_dir() and (
        (Path(path) / "model.safetensors").is_file() or (Path(path) / "model.safetensors.index.json").is_file())


def _chunks(role: str, spec: JobSpec, hf: dict, device: str, recompute: str = "none") -> list:
    from mrl.models.roles import build_role_model

    vpp = spec.parallel.virtual_pipeline
    return [build_role_model(role, hf, spec.parallel, dtype=spec.model.dtype, device=device, recompute=recompute,
                             vp_stage=i if vpp else None, attention=spec.model.attention,
                             fused=spec.model.use_fused_kernels) for i in range(vpp or 1)]


def _load(chunks: list, path: Optional[str], hf: dict, role: str) -> bool:
    from mrl.weights import load_hf_checkpoint

    if not _has_weights(path):
        return False
    report = load_hf_checkpoint(chunks, path, hf, role=role)
    log.info("%s: loaded %d tensors (%.1f MB) from %s", role, report.tensors_read, report.bytes_read / 1e6, path)
    return True


def _copy_from(dst: list, src: list) -> None:
    """Same architecture and layout: copy the actor's weights (the LM head only where both have it)."""
    from mrl.weights.layout import unwrap

    with torch.no_grad():
        for d, s in zip(dst, src):
            src_params = dict(unwrap(s).named_parameters())
            for name, p in unwrap(d).named_parameters():
                if name in src_params and src_params[name].shape == p.shape:
                    p.copy_(src_params[name])


def steps_planned(spec: JobSpec, prompts: int) -> int:
    t = spec.trainer
    if t.total_steps:
        return t.total_steps
    return t.epochs * (prompts // spec.data.prompts_per_step)


def _trainable(role: str, spec: JobSpec, hf: dict, device: str, section, total_optimizer_steps: int,
               init_from: Optional[list] = None, path: Optional[str] = None):
    from mrl.engine import Engine
    from mrl.optim.build import build_optimizer, build_scheduler, wrap_ddp

    chunks = _chunks(role, spec, hf, device, section.recompute)
    if not _load(chunks, path, hf, role) and init_from is not None:
        _copy_from(chunks, init_from)
    lora = getattr(section, "lora", None)
    if lora is not None and lora.rank:   # frozen base + adapters; checkpoints hold the adapters
        from mrl.models.lora import adapters_only_checkpoints, apply_lora

        chunks = [adapters_only_checkpoints(apply_lora(c, lora, seed=spec.job.seed)) for c in chunks]
    ddp = wrap_ddp(chunks, distributed_optimizer=spec.parallel.distributed_optimizer)
    optimizer = build_optimizer(ddp, section.optim, distributed_optimizer=spec.parallel.distributed_optimizer,
                                section=role)
    scheduler = build_scheduler(optimizer, section.optim, section.schedule, total_optimizer_steps)
    return Engine(ddp, optimizer=optimizer, scheduler=scheduler, name=role, grad_clip=section.optim.grad_clip,
                  nonfinite=section.optim.nonfinite)


def leader_work_s(spec: JobSpec, dp: int) -> float:
    """The longest a model-parallel group leader works alone in one rollout round while its group
    and the other groups wait: generating (bounded by `rollout.generate_timeout_s` where the
    rollout section has it) or scoring a round's responses (every reward call up to
    `reward.timeout_s`, a bound the reward pool enforces). Derived here, once, so a job whose
    rewards are slow but within their timeout never trips a waiting rank's collective timeout."""
    from mrl.reward.compose import scoring_budget_s

    responses = spec.data.prompts_per_step // dp * spec.rollout.responses_per_prompt
    generation = getattr(spec.rollout, "generate_timeout_s", None) or 0.0
    return max(float(generation), scoring_budget_s(spec.reward, responses))


def optimizer_steps(spec: JobSpec, section, steps: int) -> int:
    mini = spec.data.prompts_per_step // (section.mini_batch_prompts or spec.data.prompts_per_step)
    return steps * section.epochs * mini


def build(spec: JobSpec) -> Components:
    """Bring the platform up and build every component of `spec` on this rank."""
    import torch.distributed as dist

    from mrl.data.sampler import PromptSampler
    from mrl.data.source import load_prompts
    from mrl.models.megatron import hf_config
    from mrl.models.tokenizer import load_tokenizer
    from mrl.platform import setup
    from mrl.weights import Exporter

    from mrl.errors import UserError
    from mrl.models.facts import model_facts
    from mrl.rollout.layout import first_problem

    problem = first_problem(spec.rollout, spec.platform.world_size, model_facts(spec.model.path), spec.platform.device)
    if problem:   # mrl validate reports the same (mrl.config.validate)
        raise UserError(problem)
    ctx = setup(spec.platform, spec.parallel, seed=spec.job.seed)
    from megatron.core import parallel_state as ps

    from mrl.platform.dist import create_wait_group

    create_wait_group(spec.platform.collective_timeout_s + leader_work_s(spec, ctx.dp))

    hf = hf_config(spec.model)
    tokenizer = load_tokenizer(spec.model)
    device = ctx.platform
    dataset = load_prompts(spec.data, tokenizer, "train")
    total = steps_planned(spec, len(dataset))
    # One sampler batch is one generation round (dynamic sampling runs several rounds per step).
    sampler = PromptSampler(len(dataset), spec.algorithm.dynamic_sampling.generation_batch_prompts,
                            dp_rank=ctx.dp_rank, dp_size=ctx.dp, seed=spec.data.seed, shuffle=spec.data.shuffle)

    actor = _trainable("actor", spec, hf, device, spec.actor, optimizer_steps(spec, spec.actor, total),
                       path=spec.model.path)
    ref = None
    if spec.ref.enable and spec.actor.lora.rank:
        from mrl.models.lora import reference_engine

        ref = reference_engine(actor)   # the actor's frozen base, adapters off: no second copy
    elif spec.ref.enable:
        chunks = _chunks("ref", spec, hf, device)
        if not _load(chunks, spec.ref.model_path, hf, "ref"):
            _copy_from(chunks, actor.chunks)
        from mrl.engine import Engine

        ref = Engine(chunks, name="ref")
    critic = None
    if spec.critic.enable:
        critic = _trainable("critic", spec, hf, device, spec.critic, optimizer_steps(spec, spec.critic, total),
                            init_from=actor.chunks, path=spec.critic.model_path)

    reward_model = _reward_model(spec, hf, device)

    mp_group = ps.get_model_parallel_group()
    leader = dist.get_process_group_ranks(mp_group)[0] if dist.is_initialized() else 0
    comps = Components(spec=spec, ctx=ctx, hf=hf, tokenizer=tokenizer, actor=actor,
                       exporter=Exporter(actor.chunks, hf, dtype=_dtype(spec.rollout.weight_sync.dtype)),
                       ref=ref, critic=critic, dataset=dataset, sampler=sampler, total_steps=total,
                       mp_group=mp_group, mp_leader=leader, reward_model=reward_model)
    from mrl.train.engines import build_rollout

    comps.rollout, comps.generator, comps.engine_groups = build_rollout(spec, ctx, tokenizer, is_leader=comps.is_leader)
    if comps.is_leader:
        from mrl.reward.compose import Rewarder

        if reward_model is not None:
            comps.rm_scores = PrecomputedScores()
        comps.rewarder = Rewarder.from_config(spec.reward, model_scorer=comps.rm_scores)
    return comps


class PrecomputedScores:
    """The rewarder's model scorer: the reward model runs on every rank of the model-parallel
    group (its collectives need them all) before the rewarder scores on the leader, which then
    reads the scores set here for the same sequences, in order."""

    def __init__(self):
        self.scores: Optional[list[float]] = None

    def __call__(self, token_ids: list[list[int]]) -> list[float]:
        if self.scores is None or len(self.scores) != len(token_ids):
            raise RuntimeError("reward-model scores were not computed for this batch")
        out, self.scores = self.scores, None
        return out


def _reward_model(spec: JobSpec, hf: dict, device: str):
    """A frozen reward-model engine when a reward source is a model, else None."""
    from mrl.errors import UserError
    from mrl.reward.sources import reward_sources

    paths = [s.ref for s in reward_sources(spec.reward, check_files=False) if s.kind == "model"]
    if not paths:
        return None
    if len(paths) > 1:
        raise UserError(f"reward: {len(paths)} reward models configured; one is supported")
    from mrl.engine import Engine
    from mrl.models.megatron import complete_hf_config
    from mrl.models.facts import find_hf_config

    found = find_hf_config(paths[0])
    if found is None or not _has_weights(paths[0]):
        raise UserError(f"reward.model_path: {paths[0]!r} is not a Hugging Face directory with safetensors weights")
    rm_hf = complete_hf_config(found[0])
    chunks = _chunks("reward", spec, rm_hf, device)
    _load(chunks, paths[0], rm_hf, "reward")
    return Engine(chunks, name="reward")


def _dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def close(c: Components) -> None:
    if c.rewarder is not None:
        c.rewarder.close()
    if c.rollout is not None:
        c.rollout.shutdown()
