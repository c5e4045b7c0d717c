"""The `data` section: where prompts come from and how many each step consumes."""
from __future__ import annotations

from typing import Any, Literal, Optional

from mrl.schema.section import SEED_MAX, option, section


@section
class DataConfig:
    """Prompt source and per-step prompt count. Rows need a prompt and (for rule rewards) an answer."""

    train_files: tuple[str, ...] = option((), help="parquet files of training prompts")
    val_files: tuple[str, ...] = option((), help="parquet files of validation prompts")
    generator: Optional[str] = option(None, help="prompt generator 'module:function' or 'reasoning_gym:<task>' instead of files")
    generator_size: int = option(10000, ge=1, help="prompts a generator yields per epoch")
    generator_kwargs: dict[str, Any] = option(factory=dict, help="task options passed to a reasoning_gym generator (e.g. min_terms, max_terms for chain_sum)")
    prompt_key: str = option("prompt", help="column holding the prompt (string or chat messages)")
    answer_key: str = option("answer", help="column holding the ground truth passed to the reward; dotted reaches into a table column (verl: reward_model.ground_truth, used by default when the data has verl's reward_model column and no answer column)")
    source_key: str = option("data_source", help="column naming each row's data source (picks per-source rewards and metrics); optional in the files")
    bad_rows: Literal["warn", "error"] = option("warn", help="a row whose prompt or answer is missing or empty is dropped and counted (warn) or stops the run (error)")
    prompts_per_step: int = option(8, ge=1, help="prompts consumed per training step (verl: train_batch_size)")
    max_prompt_tokens: int = option(512, ge=1, help="longest prompt, in tokens")
    prompt_overflow: Literal["error", "drop", "truncate_left"] = option("drop", help="what to do with a longer prompt")
    chat_template: bool = option(True, help="apply the tokenizer's chat template to prompts")
    special_tokens_in_text: Literal["error", "escape", "allow"] = option(
        "escape", help="a prompt holding a special token's text (e.g. <|im_end|>): escape tokenizes it as plain text, "
                       "error stops the run naming the row, allow makes it the special token; escaped/allowed prompts "
                       "are counted (data/prompts_special_text_*)")
    system_prompt: Optional[str] = option(None, help="system message prepended to chat prompts")
    shuffle: bool = option(True, help="shuffle prompts every epoch (resumable)")
    seed: Optional[int] = option(None, ge=0, le=SEED_MAX, help="sampler seed (default: job.seed)")
    val_prompts: Optional[int] = option(None, ge=1, help="cap on validation prompts")
