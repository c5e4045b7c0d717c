"""The `sft` section and the SFT job root: `mrl sft JOB` reads the shared `[job]`, `[platform]`,
`[parallel]`, `[model]`, `[data]`, `[checkpoint]` and `[tracking]` sections plus its own `[sft]`.

A job file with an `[sft]` table is an SFT job (`mrl.config.loader.load` picks this root for it);
the RL sections (`rollout`, `algorithm`, `actor`, ...) are unknown keys there, so nothing in an
SFT job validates and then does nothing. Of `[data]`, SFT reads the sources (`train_files`,
`val_files`, `generator`, `generator_size`, `generator_kwargs`), `prompt_key`, `chat_template`,
`system_prompt`, `shuffle`, `seed` and `bad_rows`; setting one of the prompt-only keys
(`answer_key`, `prompts_per_step`, `max_prompt_tokens`, ...) in an SFT job is an error.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Literal, Optional

from mrl.checkpoint.config import CheckpointConfig
from mrl.config.job import JobConfig
from mrl.config.schema import option, section
from mrl.data.config import DataConfig
from mrl.models.config import ModelConfig
from mrl.models.lora import LoraConfig
from mrl.optim.config import OptimConfig, ScheduleConfig
from mrl.platform.config import ParallelConfig, PlatformConfig
from mrl.tracking.config import TrackingConfig

# `[data]` keys that only the RL prompt pipeline reads: an SFT job must leave them at their defaults.
RL_ONLY_DATA_KEYS = ("answer_key", "source_key", "prompts_per_step", "max_prompt_tokens", "prompt_overflow",
                     "val_prompts")


# verl's SFT trainer (fsdp_sft_trainer) keys -> mrl's, for unknown-key suggestions in SFT jobs
# (CONTRIBUTING.md lists them).
VERL_SFT_TO_MRL: dict[str, str] = {
    "data.train_files": "data.train_files",
    "data.val_files": "data.val_files",
    "data.prompt_key": "data.prompt_key",
    "data.response_key": "sft.response_key",
    "data.multiturn.enable": "sft.format",
    "data.multiturn.messages_key": "sft.messages_key",
    "data.train_batch_size": "sft.examples_per_step",
    "data.micro_batch_size_per_gpu": "sft.micro_batch_tokens",
    "data.max_token_len_per_gpu": "sft.micro_batch_tokens",
    "data.max_length": "sft.max_tokens",
    "data.truncation": "sft.truncation",
    "model.partial_pretrain": "model.path",
    "model.enable_gradient_checkpointing": "sft.recompute",
    "model.lora_rank": "sft.lora.rank",
    "model.lora_alpha": "sft.lora.alpha",
    "model.target_modules": "sft.lora.target_modules",
    "optim.lr": "sft.optim.lr",
    "optim.weight_decay": "sft.optim.weight_decay",
    "optim.betas": "sft.optim.beta1",
    "optim.warmup_steps_ratio": "sft.schedule.warmup_ratio",
    "optim.clip_grad": "sft.optim.grad_clip",
    "optim.lr_scheduler": "sft.schedule.decay",
    "trainer.total_epochs": "sft.epochs",
    "trainer.total_training_steps": "sft.total_steps",
    "trainer.test_freq": "sft.val_every_steps",
    "trainer.save_freq": "checkpoint.every_steps",
    "trainer.default_local_dir": "checkpoint.dir",
    "trainer.project_name": "tracking.experiment",
    "trainer.experiment_name": "tracking.run_name",
    "trainer.logger": "tracking.backends",
    "trainer.seed": "job.seed",
    "trainer.nnodes": "platform.nodes",
    "trainer.n_gpus_per_node": "platform.ranks_per_node",
    # the engine-based SFT trainer (sft_trainer_engine.yaml) and its hf_model / optim groups
    "data.messages_key": "sft.messages_key",
    "data.val_max_samples": "sft.val_examples",
    "model.tokenizer_path": "model.tokenizer",
    "model.use_liger": "model.use_fused_kernels",
    "model.lora.rank": "sft.lora.rank",
    "model.lora.alpha": "sft.lora.alpha",
    "model.lora.dropout": "sft.lora.dropout",
    "model.lora.target_modules": "sft.lora.target_modules",
    "model.lora_adapter_path": "sft.lora.adapter_path",
    "model.lora.adapter_path": "sft.lora.adapter_path",
    "optim.lr_warmup_steps_ratio": "sft.schedule.warmup_ratio",
    "optim.lr_warmup_steps": "sft.schedule.warmup_steps",
    "trainer.max_ckpt_to_keep": "checkpoint.keep_last",
    "trainer.resume_mode": "checkpoint.resume",
    "trainer.resume_path": "checkpoint.load_from",
    "trainer.resume_from_path": "checkpoint.load_from",
    "trainer.device": "platform.device",
    "ulysses_sequence_parallel_size": "parallel.context",
}

_SFT_TOKEN_BUDGET = "always on: every micro-batch is a packed token budget (sft.micro_batch_tokens), no padding"

# verl SFT trainer keys with no `mrl sft` counterpart, and why (CONTRIBUTING.md lists them).
VERL_SFT_NOT_APPLICABLE: dict[str, str] = {
    "model.exclude_modules": "adapters go only on the modules listed in sft.lora.target_modules (Hugging Face names)",
    "data.use_dynamic_bsz": _SFT_TOKEN_BUDGET,
    "data.pad_mode": _SFT_TOKEN_BUDGET,
    "use_remove_padding": _SFT_TOKEN_BUDGET,
    "data.balance_dp_token": "each DP rank packs its own share of the step's examples into token-budget micro-batches",
}


def _sft_optim() -> OptimConfig:
    return OptimConfig(lr=1e-5)


@section
class SFTConfig:
    """Supervised fine-tuning: which columns hold the targets, how long an example may be, how many
    examples make one optimizer step, and the optimizer. The loss is the token-mean cross-entropy
    over the assistant (response) tokens of the whole step (all micro-batches, all DP ranks)."""

    format: Literal["prompt_response", "messages"] = option(
        "prompt_response", help="prompt_response: data.prompt_key (text or chat messages) + sft.response_key (text); "
                                "messages: one column of chat messages (sft.messages_key), the loss on every "
                                "assistant turn (multi-turn)")
    response_key: str = option("response", help="column holding the target response (format prompt_response)")
    messages_key: str = option("messages", help="column holding a chat conversation (format messages)")
    max_tokens: int = option(2048, ge=2, help="longest example, prompt + response tokens (verl: data.max_length)")
    truncation: Literal["error", "drop", "right"] = option(
        "error", help="a longer example: error, drop it (counted), or cut its end (verl: data.truncation)")
    examples_per_step: int = option(32, ge=1, help="examples per optimizer step, all data-parallel ranks together "
                                                  "(verl: data.train_batch_size)")
    micro_batch_tokens: int = option(8192, ge=1, help="token budget of one packed micro-batch on one rank "
                                                      "(verl: max_token_len_per_gpu)")
    epochs: int = option(1, ge=1, help="passes over the training set (verl: trainer.total_epochs)")
    total_steps: Optional[int] = option(None, ge=1, help="stop after this many steps (wins over epochs)")
    val_every_steps: int = option(0, ge=0, help="validation loss every N steps and at the end; 0 = never "
                                                "(verl: trainer.test_freq)")
    val_examples: Optional[int] = option(None, ge=1, help="cap on validation examples")
    log_every_steps: int = option(1, ge=1, help="console line every N steps; MLflow records every step")
    recompute: Literal["none", "selective", "full"] = option("none", help="activation recomputation")
    lora: LoraConfig = option(factory=LoraConfig, help="LoRA adapters (rank 0 = full fine-tuning)")
    optim: OptimConfig = option(factory=_sft_optim, help="optimizer")
    schedule: ScheduleConfig = option(factory=ScheduleConfig, help="learning-rate schedule (optimizer steps)")


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


def _replace(obj, **changes):
    return dataclasses.replace(obj, **changes) if changes else obj


def resolve(spec: SFTJobSpec, default_name: str = "job") -> SFTJobSpec:
    """Derived (`None`) fields of the shared sections, by the rules RL jobs use (one place)."""
    from mrl.config.validate import resolve_shared

    return dataclasses.replace(spec, **resolve_shared(spec, default_name))


def check(spec: SFTJobSpec, report) -> None:
    """Every cross-field problem of a resolved SFT spec, one line each: the shared sections by the
    rules RL jobs use, then `[sft]` and what SFT reads of `[data]`."""
    from mrl.config.validate import check_shared

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
                                          num_experts=facts.num_experts if facts is not None else None):
            err(key, message)
    from mrl.models.lora_adapter import adapter_problems

    errors, warnings = adapter_problems(sft.lora, "sft.lora")
    for key, message in errors:
        err(key, message)
    for key, message in warnings:
        warn(key, message)
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
