"""The SFT job root: `mrl sft JOB` reads the shared `[job]`, `[platform]`, `[parallel]`, `[model]`,
`[data]`, `[checkpoint]` and `[tracking]` sections plus its own `[sft]` (`mrl/sft/config.py`).

A job file with an `[sft]` table is an SFT job (`mrl.config.loader.load` picks this root for it);
the RL sections (`rollout`, `algorithm`, `actor`, ...) are unknown keys there, so nothing in an
SFT job validates and then does nothing. Of `[data]`, SFT reads the sources (`train_files`,
`val_files`, `generator`, `generator_size`, `generator_kwargs`), `prompt_key`, `chat_template`,
`system_prompt`, `shuffle`, `seed` and `bad_rows`; setting one of the prompt-only keys
(`answer_key`, `prompts_per_step`, `max_prompt_tokens`, ...) in an SFT job is an error.
`resolve` and `check` apply the RL job's rules to the shared sections (`defaults.resolve_shared`,
`validate.check_shared`), then SFT's own.
"""
from __future__ import annotations

import dataclasses
import os

from mrl.checkpoint.config import CheckpointConfig
from mrl.config.job import JobConfig
from mrl.config.defaults import resolve_shared
from mrl.config.validate import check_shared
from mrl.data.config import DataConfig
from mrl.models.config import ModelConfig
from mrl.platform.config import ParallelConfig, PlatformConfig
from mrl.schema.section import option, section
from mrl.sft.config import SFTConfig
from mrl.tracking.config import TrackingConfig

# `[data]` keys that only the RL prompt pipeline reads: an SFT job must leave them at their defaults.
RL_ONLY_DATA_KEYS = ("answer_key", "source_key", "prompts_per_step", "max_prompt_tokens", "prompt_overflow",
                     "val_prompts")


@section
class SFTJobSpec:
    """An SFT job: the shared sections plus `[sft]`."""

    job: JobConfig = option(factory=JobConfig)
    platform: PlatformConfig = option(factory=PlatformConfig)
    parallel: ParallelConfig = option(factory=ParallelConfig)
    model: ModelConfig = option()
    data: DataConfig = option(factory=DataConfig)
    sft: SFTConfig = option(factory=SFTConfig)
    checkpoint: CheckpointConfig = option(factory=CheckpointConfig)
    tracking: TrackingConfig = option(factory=TrackingConfig)


def is_sft_table(raw: dict) -> bool:
    """Whether a raw job table is an SFT job (it has an `[sft]` table)."""
    return isinstance(raw.get("sft"), dict)


def resolve(spec: SFTJobSpec, default_name: str = "job") -> SFTJobSpec:
    """Derived (`None`) fields of the shared sections, by the rules RL jobs use (one place)."""
    return dataclasses.replace(spec, **resolve_shared(spec, default_name))


def check(spec: SFTJobSpec, report) -> None:
    """Every cross-field problem of a resolved SFT spec, one line each: the shared sections by the
    rules RL jobs use, then `[sft]` and what SFT reads of `[data]`."""
    err, warn = report.error, report.warn
    plat, par, data, sft = spec.platform, spec.parallel, spec.data, spec.sft
    world = plat.world_size
    dp, facts = check_shared(spec, report)
    if dp and sft.examples_per_step % dp:
        err("sft.examples_per_step", f"{sft.examples_per_step} examples do not split evenly over data-parallel size {dp} "
                                     f"(world size {world} / (tensor {par.tensor} x pipeline {par.pipeline} x context {par.context}))")
    from mrl.models.context_parallel import tokens_per_rank   # the engine's CP chunking

    if sft.micro_batch_tokens < tokens_per_rank(sft.max_tokens, par.context):
        err("sft.micro_batch_tokens", f"{sft.micro_batch_tokens} tokens cannot hold one example of sft.max_tokens "
                                      f"{sft.max_tokens}" + (f" ({tokens_per_rank(sft.max_tokens, par.context)} per rank "
                                                             f"of parallel.context {par.context})" if par.context > 1 else ""))
    defaults = DataConfig()
    for key in RL_ONLY_DATA_KEYS:
        if getattr(data, key) != getattr(defaults, key):
            err(f"data.{key}", "is not read by mrl sft (examples are sized by sft.max_tokens and counted by "
                               "sft.examples_per_step); remove it")
    if sft.format == "messages" and not data.chat_template:
        err("sft.format", "'messages' needs data.chat_template = true (the template marks the assistant turns)")
    if data.train_files and data.generator is not None:
        err("data.generator", "set either data.generator or data.train_files, not both")
    if not data.train_files and data.generator is None:
        err("data.train_files", "no examples: set data.train_files or data.generator")
    if data.generator is not None:
        from mrl.data.source import generator_problem

        problem = generator_problem(data.generator)
        if problem:
            err("data.generator", problem)
    for f in data.train_files + data.val_files:
        if not os.path.exists(f):
            warn("data.train_files" if f in data.train_files else "data.val_files",
                 f"{f!r} does not exist on this machine (fine if the job runs elsewhere)")
    if sft.val_every_steps and not data.val_files and data.generator is None:
        err("sft.val_every_steps", "validation needs data.val_files (or a data.generator)")
    if sft.lora.rank:
        from mrl.models.lora import lora_problems

        for key, message in lora_problems(sft.lora, "sft.lora", sequence_parallel=par.sequence_parallel,
                                          num_experts=facts.num_experts if facts is not None else None,
                                          model_type=facts.model_type if facts is not None else None):
            err(key, message)
    from mrl.models.lora_adapter import adapter_problems

    errors, warnings = adapter_problems(sft.lora, "sft.lora")
    for key, message in errors:
        err(key, message)
    for key, message in warnings:
        warn(key, message)
    from mrl.models.facts import find_hf_config
    from mrl.models.vlm import sft_problem

    found = find_hf_config(spec.model.path)   # what `mrl sft` refuses of a (vision-language) model
    problem = sft_problem(spec, found[0]) if found is not None else None
    if problem:
        key, _, message = problem.partition(": ")
        err(key, message)
    sched = sft.schedule
    if sched.warmup_ratio is not None and sched.warmup_steps:
        err("sft.schedule.warmup_ratio", f"set either warmup_ratio ({sched.warmup_ratio}) or warmup_steps ({sched.warmup_steps})")
    if sft.optim.min_lr > sft.optim.lr:
        err("sft.optim.min_lr", f"{sft.optim.min_lr} is above sft.optim.lr {sft.optim.lr}")


def summary(spec: SFTJobSpec) -> str:
    """The one line `mrl validate` prints for an SFT job."""
    p, par, s = spec.platform, spec.parallel, spec.sft
    world = p.world_size
    dp = par.data_parallel(world)
    lora = f"; LoRA rank {s.lora.rank} on {', '.join(s.lora.target_modules)}" if s.lora.rank else ""
    return (f"world {world} = DP {dp} x TP {par.tensor} x PP {par.pipeline}; SFT ({s.format}) "
            f"{s.examples_per_step} examples/step of <= {s.max_tokens} tokens, "
            f"{s.micro_batch_tokens}-token micro-batches{lora}")
