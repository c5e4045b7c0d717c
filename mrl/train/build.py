"""Build the parts of a run on this rank (`mrl.train.parts`) from a resolved job spec.

Models: the actor (trained, exported to the rollout engine every step), the reference (frozen,
when a KL term needs it), the critic (GAE) and a reward model (when `reward.model_path` is set).
Weights come from `model.path` (or the role's own path) through the weight-mapping layer; the
builtin presets start from megatron's seeded init, the reference and critic copying the actor's.

Colocated rollouts and rewards run once per model-parallel group, on its first rank (the group
leader), and their results are broadcast to the group, so every TP/PP rank trains on the same
responses. With `rollout.placement = "separate"` trainer ranks build only the models and rollout
ranks only the engines, the rewards and the prompt samplers (`mrl.platform.bridge`).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch

from mrl.config.job import JobSpec
from mrl.models.facts import has_hf_weights, builtin_preset
from mrl.platform.device import DTYPES
from mrl.train.parts import Generation, Learner, PrecomputedScores, Prompts, Run
from mrl.train.plan import StepPlan, step_plan

log = logging.getLogger(__name__)


_has_weights = has_hf_weights


def role_chunks(role: str, spec: JobSpec, hf: dict, device: str, recompute: str = "none") -> list:
    from mrl.models.roles import build_role_model

    vpp = spec.parallel.virtual_pipeline
    return [build_role_model(role, hf, spec.parallel, dtype=spec.model.dtype, device=device, recompute=recompute,
                             vp_stage=i if vpp else None, attention=spec.model.attention,
                             fused=spec.model.use_fused_kernels) for i in range(vpp or 1)]


def load_weights(chunks: list, path: Optional[str], hf: dict, role: str) -> bool:
    """Load the HF checkpoint at `path` into `chunks` (False when `path` has no weights: a preset),
    with "loading <role> weights N/M" progress lines on rank 0."""
    from mrl.tracking.startup import LoadProgress
    from mrl.weights import load_hf_checkpoint

    if not _has_weights(path):
        return False
    report = load_hf_checkpoint(chunks, path, hf, role=role, progress=LoadProgress(f"{role} weights"))
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


def with_adapters(chunks: list, lora, spec, hf: dict, key: str) -> list:
    """`chunks` with LoRA adapters (`lora`: the table at `key`) on their frozen base: B = 0, or the
    saved PEFT adapter of `lora.adapter_path`; checkpoints then hold only the adapters."""
    from mrl.models.lora import adapters_only_checkpoints, apply_lora

    chunks = [apply_lora(c, lora, seed=spec.job.seed) for c in chunks]
    if lora.adapter_path:
        from mrl.models.lora_adapter import start_adapters
        from mrl.tracking.startup import LoadProgress

        report = start_adapters(chunks, lora, hf, key, progress=LoadProgress("adapter weights"))
        log.info("%s: loaded %d adapter tensors from %s", key, report.tensors_read, lora.adapter_path)
    return [adapters_only_checkpoints(c) for c in chunks]


def steps_planned(spec: JobSpec, prompts: int) -> int:
    t = spec.trainer
    if t.total_steps:
        return t.total_steps
    return t.epochs * (prompts // spec.data.prompts_per_step)


def _trainable(role: str, spec: JobSpec, hf: dict, device: str, section, total_optimizer_steps: int,
               init_from: Optional[list] = None, path: Optional[str] = None):
    from mrl.engine import Engine
    from mrl.optim.build import build_optimizer, build_scheduler, wrap_ddp

    chunks = role_chunks(role, spec, hf, device, section.recompute)
    if not load_weights(chunks, path, hf, role) and init_from is not None:
        _copy_from(chunks, init_from)
    lora = getattr(section, "lora", None)
    if lora is not None and lora.rank:   # frozen base + adapters; checkpoints hold the adapters
        chunks = with_adapters(chunks, lora, spec, hf, f"{role}.lora")
    vision = getattr(section, "vision", None)
    if vision is not None and vision.trainable:   # before DDP: it buckets what requires gradients
        from mrl.models.vlm_gpt import set_vision_trainable

        n = set_vision_trainable(chunks, True)
        log.info("%s: vision tower trainable (%d parameters on this rank)", role, n)
    ddp = wrap_ddp(chunks, distributed_optimizer=spec.parallel.distributed_optimizer)
    optimizer = build_optimizer(ddp, section.optim, distributed_optimizer=spec.parallel.distributed_optimizer,
                                section=role)
    scheduler = build_scheduler(optimizer, section.optim, section.schedule, total_optimizer_steps)
    return Engine(ddp, optimizer=optimizer, scheduler=scheduler, name=role, grad_clip=section.optim.grad_clip,
                  nonfinite=section.optim.nonfinite)


def leader_work_s(spec: JobSpec, plan: StepPlan) -> float:
    """The longest a model-parallel group leader works alone in one rollout round while its group
    and the other groups wait: generating (bounded by `rollout.generate_timeout_s` where the
    rollout section has it) or scoring a round's responses (every reward call up to
    `reward.timeout_s`, a bound the reward pool enforces). Derived here, once, so a job whose
    rewards are slow but within their timeout never trips a waiting rank's collective timeout."""
    from mrl.reward.compose import scoring_budget_s

    responses = plan.responses_per_rank
    generation = getattr(spec.rollout, "generate_timeout_s", None) or 0.0
    return max(float(generation), scoring_budget_s(spec.reward, responses))


def kl_controller(spec: JobSpec):
    """`algorithm.kl_reward`'s coefficient controller, or None when the KL penalty is off."""
    from mrl.algos.kl import AdaptiveController, FixedController

    k = spec.algorithm.kl_reward
    if not k.enable:
        return None
    if k.controller == "adaptive":
        return AdaptiveController(k.coef, k.target, k.horizon)
    return FixedController(k.coef)


def build(spec: JobSpec) -> tuple[Run, Optional[Learner], Optional[Generation], Optional[Prompts]]:
    """Bring the platform up and build this rank's parts of `spec`: `(run, learner, generation,
    prompts)`; `learner` is None on rollout-only ranks, `generation` and `prompts` on
    trainer-only ranks."""
    import torch.distributed as dist

    from mrl.data.sampler import PromptSampler
    from mrl.data.source import load_prompts
    from mrl.errors import UserError
    from mrl.models.facts import model_facts
    from mrl.models.megatron import hf_config
    from mrl.models.tokenizer import load_tokenizer
    from mrl.platform import setup
    from mrl.platform.dist import create_wait_group
    from mrl.rollout.layout import first_problem
    from mrl.train.placement import partial_problems, separate_problems

    problem = first_problem(spec.rollout, spec.platform.world_size, model_facts(spec.model.path), spec.platform.device)
    problems = separate_problems(spec) + partial_problems(spec)
    if problem or problems:   # mrl validate reports the same (mrl.config.validate)
        raise UserError(problem or f"{problems[0][0]}: {problems[0][1]}")
    plan = step_plan(spec)   # mrl validate refuses the same plans (mrl.config.validate)
    separate, dp = plan.separate, plan.dp
    wait_s = spec.platform.collective_timeout_s + leader_work_s(spec, plan)
    ctx = setup(spec.platform, spec.parallel, seed=spec.job.seed, rollout_ranks=spec.rollout.ranks if separate else 0,
                bridge_timeout_s=wait_s)
    create_wait_group(wait_s)
    from mrl.tracking.startup import STARTUP

    par = spec.parallel
    STARTUP.say(f"process groups: world {spec.platform.world_size}, TP {par.tensor} x PP {par.pipeline}"
                + (f" x CP {par.context}" if par.context > 1 else "") + f" x DP {dp}"
                + (f" + {spec.rollout.ranks} rollout rank(s)" if separate else ""), timed=True)

    hf = hf_config(spec.model)
    tokenizer = load_tokenizer(spec.model)
    device = ctx.platform
    from mrl.rollout.multi_turn import job_tools
    from mrl.train.engine_groups import calls_tools

    generates = not separate or ctx.role == "rollout"
    tools = job_tools(spec, calls_tools=generates and calls_tools(spec, plan, ctx, is_leader=_leads(plan, ctx)))
    from mrl.data.images import model_image_processor
    from mrl.models.vlm import training_problem

    problem = training_problem(spec, hf)
    if problem:
        raise UserError(problem)
    images = model_image_processor(spec.model.path, hf)
    dataset = load_prompts(spec.data, tokenizer, "train", tools=tools.prompt_schemas, images=images)
    total = steps_planned(spec, len(dataset))
    run = Run(spec=spec, ctx=ctx, hf=hf, tokenizer=tokenizer, total_steps=total, plan=plan, images=images)
    STARTUP.say(f"prompts: {len(dataset)} training prompts, tokenizer of {spec.model.tokenizer}", timed=True)

    learner = None
    if ctx.role == "train":
        learner = build_learner(spec, plan, hf, device, total)
    generation = None
    # trainer ranks of a separate placement sample nothing
    prompts = Prompts(dataset=dataset, samplers={}, tool_schemas=tools.prompt_schemas)
    if generates:
        # One sampler batch is one generation round (dynamic sampling runs several rounds per step).
        # separate: engine group g of G generates for every G-th trainer DP rank; a driver generates for all
        from mrl.train.driver import shards_of

        shards = shards_of(spec, plan, ctx, 0 if separate else _colocated_leader(ctx)[1])
        samplers = {d: PromptSampler(len(dataset), spec.algorithm.dynamic_sampling.generation_batch_prompts,
                                     dp_rank=d, dp_size=dp, seed=spec.data.seed, shuffle=spec.data.shuffle)
                    for d in shards}
        prompts = Prompts(dataset=dataset, samplers=samplers, tool_schemas=tools.prompt_schemas)
        generation = build_generation(spec, plan, ctx, tokenizer,
                                      reward_model=learner.reward_model if learner else None, tools=tools)
        STARTUP.say(f"rollout engine: {spec.rollout.engine}", timed=True)
    return run, learner, generation, prompts


def build_learner(spec: JobSpec, plan: StepPlan, hf: dict, device: str, total: int) -> Learner:
    """The actor (with its exporter), reference, critic and reward model on a trainer rank."""
    from mrl.tracking.startup import STARTUP

    actor = _trainable("actor", spec, hf, device, spec.actor, plan.actor.optimizer_steps * total,
                       path=spec.model.path)
    lora = spec.actor.lora
    STARTUP.say(f"actor: {spec.model.path}" + (f", LoRA rank {lora.rank}" if lora.rank else "")
                + (f" from {lora.adapter_path}" if lora.adapter_path else ""), timed=True)
    from mrl.train.moe import attach

    attach(actor, hf)   # MoE: routing replay and the moe/* metrics
    ref = None
    if spec.ref.enable and spec.actor.lora.rank:
        from mrl.engine.reference import reference_engine

        ref = reference_engine(actor)   # the actor's frozen base, adapters off: no second copy
    elif spec.ref.enable:
        chunks = role_chunks("ref", spec, hf, device)
        if not load_weights(chunks, spec.ref.model_path, hf, "ref"):
            _copy_from(chunks, actor.chunks)
        from mrl.engine import Engine

        ref = Engine(chunks, name="ref")
    critic = None
    if spec.critic.enable:
        critic = _trainable("critic", spec, hf, device, spec.critic, plan.critic.optimizer_steps * total,
                            init_from=actor.chunks, path=spec.critic.model_path)
    from mrl.weights import Exporter

    if ref is not None or critic is not None:
        STARTUP.say("models: " + ", ".join(n for n, m in (("reference", ref), ("critic", critic)) if m is not None),
                    timed=True)
    teacher = None
    if spec.distill.model_path is not None:
        from mrl.models.tokenizer import load_tokenizer

        teacher = build_teacher(spec, device, load_tokenizer(spec.model), int(hf["vocab_size"]))
        STARTUP.say(f"teacher: {spec.distill.model_path}", timed=True)
    reward_model = build_reward_model(spec, hf, device)
    if reward_model is not None:
        STARTUP.say("reward model: loaded", timed=True)
    from mrl.weights.fp8 import from_config as fp8_stream

    exporter = Exporter(actor.chunks, hf, dtype=DTYPES[spec.rollout.weight_sync.dtype], quantize=fp8_stream(spec.rollout))
    return Learner(actor=actor, exporter=exporter,
                   ref=ref, critic=critic, reward_model=reward_model, kl=kl_controller(spec), teacher=teacher)


def _colocated_leader(ctx) -> tuple:
    """(model-parallel group, the global rank of its leader: its first rank) of a colocated rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    mp_group = ps.get_model_parallel_group()
    return mp_group, dist.get_process_group_ranks(mp_group)[0] if dist.is_initialized() else 0


def _leads(plan: StepPlan, ctx) -> bool:
    """Whether this rank generates and scores for its group (`Generation.is_leader`)."""
    if ctx.role == "rollout":
        return ctx.rank == plan.engine_leader_of(ctx.rank)
    return ctx.rank == _colocated_leader(ctx)[1]


def build_generation(spec: JobSpec, plan: StepPlan, ctx, tokenizer, *, reward_model=None, tools=None) -> Generation:
    """This rank's engine, generator, rewarder and leadership (every rank of the rollout's world
    calls it: vllm engines are built collectively). `tools`: this rank's multi-turn `JobTools`
    (`mrl.rollout.multi_turn.job_tools`, which `build` lists once for the prompts too), else they
    are built here."""
    from mrl.train.engine_groups import build_rollout, calls_tools

    if ctx.role == "rollout":   # separate: the first rank of each engine group scores
        leader = ctx.global_rank - ctx.rank + plan.engine_leader_of(ctx.rank)
        group = None
        if plan.engine_ranks > 1:   # the engine group's ranks share its leader's scores
            from mrl.rollout.engine import engine_group

            group = engine_group(plan.engine_ranks)[0]
        gen = Generation(mp_group=group, leader=leader, is_leader=ctx.global_rank == leader)
    else:
        mp_group, leader = _colocated_leader(ctx)
        gen = Generation(mp_group=mp_group, leader=leader, is_leader=ctx.rank == leader)
    if tools is None and spec.rollout.multi_turn.enable:
        from mrl.rollout.multi_turn import job_tools

        tools = job_tools(spec, calls_tools=calls_tools(spec, plan, ctx, is_leader=gen.is_leader))
    gen.tool_schemas = tools.prompt_schemas if tools is not None else None
    gen.engine, gen.generator, gen.groups = build_rollout(spec, plan, ctx, tokenizer, is_leader=gen.is_leader,
                                                          tools=tools)
    from mrl.train.driver import connect_leaders
    from mrl.tracking.startup import STARTUP

    line = connect_leaders(spec, ctx, gen)   # rollout.router = "driver": one router over every leader's engine
    if line:
        STARTUP.say(line, timed=True)
    if ctx.role != "rollout" and gen.engine is not None:
        from mrl.rollout.weight_channel import ColocatedChannel

        group = (f"rank {ctx.global_rank}" if spec.rollout.engine == "hf"
                 else f"{plan.engine_group_of(ctx.rank)} (rank {ctx.global_rank})")
        gen.channel = ColocatedChannel.from_config(gen.engine, spec.rollout.weight_sync, group=group)
    if gen.is_leader:
        from mrl.reward.compose import Rewarder

        if reward_model is not None:
            gen.rm_scores = PrecomputedScores()
        run_dir = Path(spec.job.output_dir) / spec.job.name   # unwritable from reward workers (Landlock)
        gen.rewarder = Rewarder.from_config(spec.reward, model_scorer=gen.rm_scores,
                                            protect_dirs=(str(run_dir), spec.checkpoint.dir),
                                            device=ctx.device, seed=spec.job.seed + ctx.global_rank)   # a local judge
    return gen


def build_teacher(spec: JobSpec, device: str, tokenizer, student_vocab: int):
    """`mrl.train.teacher.Teacher`: this rank's shard of the teacher, with its weights loaded (and its tokenizer
    where it differs from the student's); a `UserError` naming `distill.model_path` for what `teacher_problems` finds."""
    import dataclasses

    from mrl.engine import Engine
    from mrl.models.megatron import hf_config
    from mrl.models.roles import build_role_model
    from mrl.errors import UserError
    from mrl.models.tokenizer import load_tokenizer
    from mrl.train.teacher import Teacher, teacher_problems, teacher_process_groups

    cfg = spec.distill
    model = dataclasses.replace(spec.model, path=cfg.model_path, tokenizer=None)
    problems = teacher_problems(spec, tokenizer, student_vocab)
    if problems:
        raise UserError(f"{problems[0][0]}: {problems[0][1]}")
    hf = hf_config(model)
    vpp = spec.parallel.virtual_pipeline
    tp = cfg.parallel.tensor or spec.parallel.tensor
    groups, tp_group = teacher_process_groups(tp)   # its own tensor-parallel layout (None: the job's)
    parallel = dataclasses.replace(spec.parallel, tensor=tp, sequence_parallel=spec.parallel.sequence_parallel and groups is None,
                                   expert_tensor=spec.parallel.expert_tensor or spec.parallel.tensor)
    copies = spec.parallel.tensor // tp
    chunks = [build_role_model("ref", hf, parallel, dtype=cfg.dtype, device=device, vp_stage=i if vpp else None,
                               attention=spec.model.attention, fused=spec.model.use_fused_kernels,
                               vocab_multiple=128 * copies, pg_collection=groups)
              for i in range(vpp or 1)]
    load_weights(chunks, cfg.model_path, hf, "ref")
    theirs = load_tokenizer(model)
    other = theirs.get_vocab() != tokenizer.get_vocab()   # read through mrl.train.retokenize
    return Teacher(engine=Engine(chunks, name="teacher"), vocab_size=int(hf["vocab_size"]),
                   tokenizer=theirs if other else None, student_tokenizer=tokenizer if other else None,
                   tp_group=tp_group, copies=copies)


def build_reward_model(spec: JobSpec, hf: dict, device: str):
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
    chunks = role_chunks("reward", spec, rm_hf, device)
    load_weights(chunks, paths[0], rm_hf, "reward")
    return Engine(chunks, name="reward")


def close(generation: Optional[Generation]) -> None:
    """Stop the reward workers, a multi-turn loop's tool servers and the rollout engine."""
    if generation is None:
        return
    if generation.rewarder is not None:
        generation.rewarder.close()
    tools = getattr(generation.generator, "tools", None)   # MultiTurnRollout's ToolRunner (MCP sessions, pools)
    if tools is not None:
        tools.close()
    if generation.engine is not None:
        generation.engine.shutdown()
