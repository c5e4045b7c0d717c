"""Closest-key suggestions for unknown keys, including verl's names for the same setting."""
from __future__ import annotations

import difflib

# verl key -> mrl key, for the keys whose meaning carries over. Also printed in CONTRIBUTING.md.
VERL_TO_MRL: dict[str, str] = {
    "data.train_files": "data.train_files",
    "data.val_files": "data.val_files",
    "data.prompt_key": "data.prompt_key",
    "data.train_batch_size": "data.prompts_per_step",
    "data.max_prompt_length": "data.max_prompt_tokens",
    "data.max_response_length": "rollout.max_response_tokens",
    "data.gen_batch_size": "algorithm.dynamic_sampling.generation_batch_prompts",
    "data.filter_overlong_prompts": "data.prompt_overflow",
    "data.shuffle": "data.shuffle",
    "actor_rollout_ref.model.path": "model.path",
    "actor_rollout_ref.model.trust_remote_code": "model.trust_remote_code",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "actor.recompute",
    "actor_rollout_ref.model.use_fused_kernels": "model.use_fused_kernels",
    "actor_rollout_ref.actor.optim.lr": "actor.optim.lr",
    "actor_rollout_ref.actor.optim.weight_decay": "actor.optim.weight_decay",
    "actor_rollout_ref.actor.optim.lr_warmup_steps": "actor.schedule.warmup_steps",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": "actor.schedule.warmup_ratio",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "actor.mini_batch_prompts",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "actor.micro_batch_tokens",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "actor.micro_batch_tokens",
    "actor_rollout_ref.actor.ppo_epochs": "actor.epochs",
    "actor_rollout_ref.actor.shuffle": "actor.shuffle",
    "actor_rollout_ref.actor.grad_clip": "actor.optim.grad_clip",
    "actor_rollout_ref.actor.clip_ratio": "algorithm.clip_low",
    "actor_rollout_ref.actor.clip_ratio_low": "algorithm.clip_low",
    "actor_rollout_ref.actor.clip_ratio_high": "algorithm.clip_high",
    "actor_rollout_ref.actor.clip_ratio_c": "algorithm.dual_clip",
    "actor_rollout_ref.actor.loss_agg_mode": "algorithm.loss_aggregation",
    "actor_rollout_ref.actor.policy_loss.loss_mode": "algorithm.policy_loss",
    "actor_rollout_ref.actor.entropy_coeff": "algorithm.entropy_coef",
    "actor_rollout_ref.actor.use_kl_loss": "algorithm.kl_loss.enable",
    "actor_rollout_ref.actor.kl_loss_coef": "algorithm.kl_loss.coef",
    "actor_rollout_ref.actor.kl_loss_type": "algorithm.kl_loss.estimator",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": "parallel.tensor",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": "parallel.pipeline",
    "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size": "parallel.virtual_pipeline",
    "actor_rollout_ref.actor.megatron.context_parallel_size": "parallel.context",
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size": "parallel.expert",
    "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size": "parallel.expert_tensor",
    "actor_rollout_ref.actor.megatron.sequence_parallel": "parallel.sequence_parallel",
    "actor_rollout_ref.actor.megatron.use_distributed_optimizer": "parallel.distributed_optimizer",
    "actor_rollout_ref.actor.megatron.optimizer_offload": "actor.optim.offload",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "ref.micro_batch_tokens",
    "actor_rollout_ref.rollout.name": "rollout.engine",
    "actor_rollout_ref.rollout.n": "rollout.responses_per_prompt",
    "actor_rollout_ref.rollout.temperature": "rollout.temperature",
    "actor_rollout_ref.rollout.top_k": "rollout.top_k",
    "actor_rollout_ref.rollout.top_p": "rollout.top_p",
    "actor_rollout_ref.rollout.do_sample": "rollout.do_sample",
    "actor_rollout_ref.rollout.repetition_penalty": "rollout.repetition_penalty",
    "actor_rollout_ref.rollout.prompt_length": "data.max_prompt_tokens",
    "actor_rollout_ref.rollout.response_length": "rollout.max_response_tokens",
    "actor_rollout_ref.rollout.dtype": "rollout.dtype",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "actor_rollout_ref.rollout.ignore_eos": "rollout.ignore_eos",
    "actor_rollout_ref.rollout.enforce_eager": "rollout.enforce_eager",
    "actor_rollout_ref.rollout.free_cache_engine": "rollout.sleep_level",
    "actor_rollout_ref.rollout.enable_sleep_mode": "rollout.sleep_level",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "rollout.tensor_parallel",
    "actor_rollout_ref.rollout.pipeline_model_parallel_size": "rollout.pipeline_parallel",
    "actor_rollout_ref.rollout.expert_parallel_size": "rollout.expert_parallel",
    "actor_rollout_ref.rollout.max_num_batched_tokens": "rollout.max_num_batched_tokens",
    "actor_rollout_ref.rollout.max_model_len": "rollout.max_model_len",
    "actor_rollout_ref.rollout.max_num_seqs": "rollout.max_num_seqs",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "actor.logprob_micro_batch_tokens",
    "actor_rollout_ref.rollout.enable_chunked_prefill": "rollout.enable_chunked_prefill",
    "actor_rollout_ref.rollout.enable_prefix_caching": "rollout.enable_prefix_caching",
    "actor_rollout_ref.rollout.load_format": "rollout.load_format",
    "actor_rollout_ref.rollout.quantization": "rollout.quantization",
    "actor_rollout_ref.rollout.disable_log_stats": "rollout.disable_log_stats",
    "actor_rollout_ref.rollout.cudagraph_capture_sizes": "rollout.cudagraph_capture_sizes",
    "actor_rollout_ref.rollout.engine_kwargs": "rollout.engine_kwargs",
    "actor_rollout_ref.rollout.val_kwargs.n": "rollout.validation.responses_per_prompt",
    "actor_rollout_ref.rollout.val_kwargs.temperature": "rollout.validation.temperature",
    "actor_rollout_ref.rollout.val_kwargs.top_k": "rollout.validation.top_k",
    "actor_rollout_ref.rollout.val_kwargs.top_p": "rollout.validation.top_p",
    "actor_rollout_ref.rollout.val_kwargs.do_sample": "rollout.validation.do_sample",
    "actor_rollout_ref.rollout.multi_turn.enable": "rollout.multi_turn.enable",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": "rollout.multi_turn.max_assistant_turns",
    "actor_rollout_ref.rollout.multi_turn.max_user_turns": "rollout.multi_turn.max_user_turns",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": "rollout.multi_turn.tool_config",
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path": "rollout.multi_turn.interaction_config",
    "actor_rollout_ref.rollout.multi_turn.max_parallel_calls": "rollout.multi_turn.max_parallel_calls",
    "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": "rollout.multi_turn.max_tool_response_tokens",
    "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side": "rollout.multi_turn.tool_response_truncate_side",
    "actor_rollout_ref.rollout.multi_turn.format": "rollout.multi_turn.format",
    "actor_rollout_ref.rollout.update_weights_bucket_megabytes": "rollout.weight_sync.bucket_mb",
    "critic.enable": "critic.enable",
    "critic.model.path": "critic.model_path",
    "critic.optim.lr": "critic.optim.lr",
    "critic.ppo_mini_batch_size": "critic.mini_batch_prompts",
    "critic.ppo_max_token_len_per_gpu": "critic.micro_batch_tokens",
    "critic.ppo_epochs": "critic.epochs",
    "critic.cliprange_value": "algorithm.value_clip",
    "critic.grad_clip": "critic.optim.grad_clip",
    "reward_model.enable": "reward.model_path",
    "reward_model.model.path": "reward.model_path",
    "custom_reward_function.path": "reward.function",
    "custom_reward_function.name": "reward.function",
    "algorithm.adv_estimator": "algorithm.advantage",
    "algorithm.gamma": "algorithm.gamma",
    "algorithm.lam": "algorithm.lam",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.norm_by_std",
    "algorithm.use_kl_in_reward": "algorithm.kl_reward.enable",
    "algorithm.kl_penalty": "algorithm.kl_reward.estimator",
    "algorithm.kl_ctrl.type": "algorithm.kl_reward.controller",
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl_reward.coef",
    "algorithm.kl_ctrl.target_kl": "algorithm.kl_reward.target",
    "algorithm.kl_ctrl.horizon": "algorithm.kl_reward.horizon",
    "algorithm.rollout_correction.rollout_is": "algorithm.correction.level",
    "algorithm.rollout_correction.rollout_is_threshold": "algorithm.correction.threshold",
    "algorithm.filter_groups.enable": "algorithm.dynamic_sampling.enable",
    "algorithm.filter_groups.metric": "algorithm.dynamic_sampling.metric",
    "algorithm.filter_groups.max_num_gen_batches": "algorithm.dynamic_sampling.max_generation_batches",
    "reward_model.overlong_buffer.enable": "algorithm.overlong.enable",
    "reward_model.overlong_buffer.len": "algorithm.overlong.buffer_tokens",
    "reward_model.overlong_buffer.penalty_factor": "algorithm.overlong.penalty_factor",
    "trainer.nnodes": "platform.nodes",
    "trainer.n_gpus_per_node": "platform.ranks_per_node",
    "trainer.total_epochs": "trainer.epochs",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.test_freq": "trainer.val_every_steps",
    "trainer.val_before_train": "trainer.val_before_train",
    "trainer.save_freq": "checkpoint.every_steps",
    "trainer.default_local_dir": "checkpoint.dir",
    "trainer.resume_mode": "checkpoint.resume",
    "trainer.max_actor_ckpt_to_keep": "checkpoint.keep_last",
    "trainer.critic_warmup": "critic.warmup_steps",
    "trainer.project_name": "tracking.experiment",
    "trainer.experiment_name": "tracking.run_name",
    "trainer.logger": "tracking.backends",
    "trainer.seed": "job.seed",
    "actor_rollout_ref.rollout.online_quant": "rollout.quantization",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "actor.logprob_micro_batch_tokens",
    "actor_rollout_ref.rollout.seed": "rollout.seed",
    "actor_rollout_ref.rollout.logprobs_mode": "rollout.logprobs_mode",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "ref.micro_batch_tokens",
    "critic.ppo_micro_batch_size_per_gpu": "critic.micro_batch_tokens",
    "reward_model.micro_batch_size_per_gpu": "reward.micro_batch_tokens",
    "reward_model.reward_fn.path": "reward.function",
    "reward_model.reward_fn.name": "reward.function",
    "actor_rollout_ref.model.lora_rank": "actor.lora.rank",
    "actor_rollout_ref.model.lora_alpha": "actor.lora.alpha",
    "actor_rollout_ref.model.target_modules": "actor.lora.target_modules",
    # verl's Megatron backend (Megatron-Bridge LoRA) nests them under model.lora
    "actor_rollout_ref.model.lora.rank": "actor.lora.rank",
    "actor_rollout_ref.model.lora.alpha": "actor.lora.alpha",
    "actor_rollout_ref.model.lora.dropout": "actor.lora.dropout",
    "actor_rollout_ref.model.lora.target_modules": "actor.lora.target_modules",
}

_PARAM_OFFLOAD = ("parameter offload is not implemented: trainer parameters stay on the device (the rollout engine "
                  "frees its own memory with rollout.sleep_level; actor.optim.offload moves optimizer state to the host)")
_OVER_SAMPLE = ("mrl generates synchronously and keeps every response; long-tail requests are bounded by "
                "rollout.max_response_tokens and rollout.generate_timeout_s")
_SKIP_TOKENIZER = "always on: mrl's vLLM engine works on token ids and the trainer detokenizes"
_ADAPTER_PATH = ("training does not start from a saved adapter: merge it into its base (`mrl merge CKPT OUT`) and "
                 "use OUT as model.path; new adapters then start from B = 0 on that model")
_EXCLUDE = "adapters go only on the modules listed in actor.lora.target_modules (Hugging Face names); list those"
_SHM = "each rank reads only its own slices of the safetensors files; there is no /dev/shm preload"
_BALANCE = ("ranks are not re-balanced: each rank packs its own responses into token-budget micro-batches "
            "(actor.micro_batch_tokens)")

# verl keys with no mrl counterpart, and why (CONTRIBUTING.md lists them).
VERL_NOT_APPLICABLE: dict[str, str] = {
    "actor_rollout_ref.rollout.mode": "mrl is SPMD: generation is synchronous inside the training step",
    "actor_rollout_ref.rollout.server": "no rollout servers: engines run inside the trainer ranks (external_launcher)",
    "actor_rollout_ref.rollout.agent": "no agent-loop workers: multi-turn runs inside the engine ranks",
    "actor_rollout_ref.rollout.data_parallel_size": "derived: world size / (rollout.tensor_parallel x rollout.pipeline_parallel)",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": "always on: every micro-batch is a token budget",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": "global sequence counts are not used; see actor.logprob_micro_batch_tokens",
    "actor_rollout_ref.actor.ppo_micro_batch_size": "global sequence counts are not used; see actor.micro_batch_tokens",
    "actor_rollout_ref.actor.use_dynamic_bsz": "always on: every micro-batch is a token budget",
    "actor_rollout_ref.actor.use_torch_compile": "the Megatron path uses fused kernels (mrl_kernels), not torch.compile",
    "actor_rollout_ref.actor.strategy": "Megatron only",
    "actor_rollout_ref.actor.peft": "LoRA is the actor.lora table (rank, alpha, dropout, target_modules)",
    "actor_rollout_ref.rollout.calculate_log_probs": "always on: the engine's per-token log-probs are always recorded",
    "trainer.prometheus": "metrics go to MLflow and the console",
    "actor_rollout_ref.actor.megatron.param_offload": _PARAM_OFFLOAD,
    "actor_rollout_ref.ref.megatron.param_offload": _PARAM_OFFLOAD,
    "critic.megatron.param_offload": _PARAM_OFFLOAD,
    "actor_rollout_ref.rollout.over_sample_rate": _OVER_SAMPLE,
    "actor_rollout_ref.rollout.skip_tokenizer_init": _SKIP_TOKENIZER,
    "trainer.balance_batch": _BALANCE,
    "actor_rollout_ref.model.lora_adapter_path": _ADAPTER_PATH,
    "actor_rollout_ref.model.lora.adapter_path": _ADAPTER_PATH,
    "actor_rollout_ref.model.exclude_modules": _EXCLUDE,
    "actor_rollout_ref.model.lora.exclude_modules": _EXCLUDE,
    "actor_rollout_ref.model.lora.type": ("plain LoRA with one A and one B per Hugging Face projection, q/k/v and "
                                          "gate/up included (Megatron-Bridge's canonical_lora); DoRA and VLM LoRA "
                                          "are not built"),
    "actor_rollout_ref.model.lora.dropout_position": "actor.lora.dropout applies to the adapter input (pre), as PEFT",
    "actor_rollout_ref.model.lora.lora_A_init_method": "A starts as PEFT's (Kaiming-uniform), B at zero",
    "actor_rollout_ref.model.lora.lora_B_init_method": "A starts as PEFT's (Kaiming-uniform), B at zero",
    "actor_rollout_ref.model.use_shm": _SHM,
    "actor_rollout_ref.rollout.layered_summon": ("weight sync streams merged weights tensor by tensor in buckets "
                                                 "(rollout.weight_sync.bucket_mb); no whole model is gathered"),
    "critic.model.lora.rank": "the critic trains every weight; LoRA is for the actor (actor.lora) and SFT (sft.lora)",
}

# mrl keys that existed once and were removed because mrl did not act on them: a job that still
# sets one gets this reason instead of "unknown key".
REMOVED_KEYS: dict[str, str] = {
    "actor.offload_params": _PARAM_OFFLOAD,
    "critic.offload_params": _PARAM_OFFLOAD,
    "ref.offload_params": _PARAM_OFFLOAD,
    "rollout.over_sample_rate": _OVER_SAMPLE,
    "rollout.skip_tokenizer_init": _SKIP_TOKENIZER,
    "trainer.balance_batch": _BALANCE,
    "checkpoint.async_save": "checkpoints are written synchronously (atomic rename, manifest last); background "
                             "saves are not built, so the key was removed",
}


def explain_unknown(unknown: str, siblings: list[str], valid_keys: list[str]) -> str:
    """The message for an unknown key: why a removed or inapplicable key has no mrl setting, or
    "unknown key; did you mean `x`?"."""
    reason = REMOVED_KEYS.get(unknown) or VERL_NOT_APPLICABLE.get(unknown)
    if reason is None and "sft.examples_per_step" in valid_keys:   # an SFT job: verl's SFT trainer names
        from mrl.sft.config import VERL_SFT_NOT_APPLICABLE

        reason = VERL_SFT_NOT_APPLICABLE.get(unknown)
    if reason is not None:
        return f"not an mrl key: {reason}; remove it"
    hint = suggest(unknown, siblings, valid_keys)
    return "unknown key" + (f"; did you mean `{hint}`?" if hint else "")

# Leaf names that are too generic to map on their own ("enable", "path", ...).
_AMBIGUOUS_LEAVES = {"enable", "path", "name", "type", "lr", "len"}


def _verl_leaf_map() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for verl, mrl in VERL_TO_MRL.items():
        leaf = verl.rsplit(".", 1)[-1]
        if verl.rsplit(".", 1)[-1] == mrl.rsplit(".", 1)[-1]:
            continue  # same name: the sibling/leaf search finds it
        out.setdefault(leaf, []).append(mrl)
    return out


_VERL_LEAVES = _verl_leaf_map()


def suggest(unknown: str, siblings: list[str], valid_keys: list[str]) -> str | None:
    """The most likely intended dotted key for `unknown`, or None.

    Tries, in order: a close sibling at the same level; verl's name for an mrl key; the same leaf
    name at another level (`actor.lr` -> `actor.optim.lr`); a close match over all dotted keys.
    """
    prefix, _, leaf = unknown.rpartition(".")
    prefix = prefix + "." if prefix else ""
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.75)
    if close:
        return prefix + close[0]
    verl = VERL_TO_MRL
    if "sft.examples_per_step" in valid_keys:   # an SFT job: verl's SFT trainer names (mrl/sft/config.py)
        from mrl.sft.config import VERL_SFT_TO_MRL as verl
    if unknown in verl:
        return verl[unknown]
    top = unknown.split(".", 1)[0]
    if leaf in _VERL_LEAVES and leaf not in _AMBIGUOUS_LEAVES:
        targets = _VERL_LEAVES[leaf]
        same_section = [t for t in targets if t.split(".", 1)[0] == top]
        return (same_section or targets)[0]
    same_leaf = [k for k in valid_keys if k.rsplit(".", 1)[-1] == leaf]
    if same_leaf:
        same_section = [k for k in same_leaf if k.split(".", 1)[0] == top]
        return min(same_section or same_leaf, key=len)
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    if close:
        return prefix + close[0]
    close = difflib.get_close_matches(unknown, valid_keys, n=1, cutoff=0.7)
    return close[0] if close else None
