"""mrl.data: prompt datasets (parquet files, generators, reasoning-gym), chat templates, the sampler.

Entry points for the trainer: `mrl.data.source.load_prompts(cfg.data, tokenizer, split)` ->
`PromptDataset` (items + `stats` counts to log) and `mrl.data.sampler.PromptSampler(len(dataset),
cfg.data.prompts_per_step, dp_rank=, dp_size=, seed=cfg.data.seed, shuffle=cfg.data.shuffle)` with
`state_dict()` / `load_state_dict()` for checkpoints.
"""
