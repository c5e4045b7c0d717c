"""The prompt dataset of a job: parquet files or a generator, templated, tokenized and counted.

`load_prompts(cfg, tokenizer, split)` is the one entry point the trainer calls; it returns a
`PromptDataset` whose `stats` (rows read, rows dropped by reason, prompts truncated or dropped for
length, prompts kept) the trainer logs once.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Literal

from mrl.data import gym
from mrl.data.config import DataConfig
from mrl.data.parquet import read_parquet_rows
from mrl.data.prompts import PromptDataset, tokenize_rows
from mrl.data.rows import Columns, PromptRow, rows_from_records
from mrl.errors import UserError

VAL_SEED_OFFSET = 1_000_003  # generated validation prompts use another seed than training ones


def columns_of(cfg: DataConfig) -> Columns:
    return Columns(prompt=cfg.prompt_key, answer=cfg.answer_key, source=cfg.source_key)


def generated_records(cfg: DataConfig, size: int, seed: int) -> list[dict]:
    """Records from `data.generator`: a reasoning-gym task or a `module:function(size, seed)`."""
    ref = cfg.generator
    if gym.is_gym_generator(ref):
        return gym.gym_records(ref[len(gym.PREFIX):], size, seed, prompt_key=cfg.prompt_key,
                               answer_key=cfg.answer_key, source_key=cfg.source_key, **cfg.generator_kwargs)
    from mrl.reward.function import load_function

    records = load_function(ref, what="data.generator")(size, seed)
    if not isinstance(records, (list, tuple)) or not all(isinstance(r, dict) for r in records):
        raise UserError(f"data.generator: {ref} must return a list of dicts (rows), got {type(records).__name__}")
    return list(records)


def load_rows(cfg: DataConfig, split: Literal["train", "val"] = "train", *, require_answer: bool = True,
              stats: Counter | None = None) -> list[PromptRow]:
    """Validated rows of `split` (files if set, else the generator), before templating."""
    files = cfg.train_files if split == "train" else cfg.val_files
    columns = columns_of(cfg)
    if files:
        return read_parquet_rows(files, columns=columns, bad_rows=cfg.bad_rows, require_answer=require_answer,
                                 stats=stats)
    if cfg.generator is None:
        raise UserError(f"no {split} prompts: set data.{split}_files or data.generator")
    seed = cfg.seed if cfg.seed is not None else 0
    size = cfg.generator_size
    if split == "val":
        seed, size = seed + VAL_SEED_OFFSET, min(size, cfg.val_prompts or size)
    default_source = cfg.generator.rpartition(":")[2]
    return rows_from_records(generated_records(cfg, size, seed), columns=columns, default_source=default_source,
                             where=f"data.generator {cfg.generator}", bad_rows=cfg.bad_rows,
                             require_answer=require_answer, stats=stats)


def load_prompts(cfg: DataConfig, tokenizer: Any, split: Literal["train", "val"] = "train", *,
                 require_answer: bool = True, tools: list[dict] | None = None, images: Any = None) -> PromptDataset:
    """Rows of `split`, rendered with the job's chat settings, tokenized and length-checked.

    `require_answer=False` when only a reward model scores (rows then need no answer column).
    Validation prompts are capped at `data.val_prompts`. `tools`: the multi-turn job's function
    schemas, listed by the chat template (`mrl.rollout.multi_turn.prompt_tools`, `JobTools.prompt_schemas`).
    `images`: a vision-language model's `mrl.data.images.ImageProcessor` (`mrl.data.images.model_image_processor`).
    """
    stats: Counter = Counter({"rows_read": 0, "rows_bad_prompt": 0, "rows_missing_answer": 0})
    rows = load_rows(cfg, split, require_answer=require_answer, stats=stats)
    if split == "val" and cfg.val_prompts is not None:
        rows = rows[:cfg.val_prompts]
    dataset = tokenize_rows(rows, tokenizer, max_prompt_tokens=cfg.max_prompt_tokens, overflow=cfg.prompt_overflow,
                            chat_template=cfg.chat_template, system_prompt=cfg.system_prompt, stats=stats,
                            special_tokens_in_text=cfg.special_tokens_in_text, tools=tools, images=images,
                            bad_rows=cfg.bad_rows)
    if not dataset.items:
        raise UserError(f"no {split} prompts left after filtering: {dataset.stats}")
    return dataset


def generator_problem(ref: str) -> str | None:
    """Why `data.generator` cannot be used (unknown reasoning-gym task, missing function), or None.
    Static: user generator files are parsed, not run."""
    if gym.is_gym_generator(ref):
        return gym.task_problem(ref[len(gym.PREFIX):])
    from mrl.reward.function import static_problem

    return static_problem(ref, n_args=2, signature="generator(size, seed)")
