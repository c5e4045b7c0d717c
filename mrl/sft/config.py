"""The `[sft]` section of `mrl sft` (the SFT job root is `mrl/config/sft_job.py`), and verl's SFT
trainer keys: their mrl names, and the ones with no mrl counterpart and why.
"""
from __future__ import annotations

from typing import Literal, Optional

from mrl.models.config import VisionConfig
from mrl.models.lora import LoraConfig
from mrl.optim.config import OptimConfig, ScheduleConfig
from mrl.schema.section import option, section

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
    vision: VisionConfig = option(factory=VisionConfig, help="the vision tower of a vision-language model")
    optim: OptimConfig = option(factory=_sft_optim, help="optimizer")
    schedule: ScheduleConfig = option(factory=ScheduleConfig, help="learning-rate schedule (optimizer steps)")
