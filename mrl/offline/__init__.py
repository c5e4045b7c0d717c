"""`mrl eval` and `mrl generate`: a checkpoint's policy used without training it, in one process.

- `target`: what to load: the job (a job file, or a run directory's recorded spec) and the
  checkpoint step (the latest, `--step N`, or none: the job's `model.path`).
- `session`: the checkpoint's weights as a Hugging Face directory (through `mrl merge`, whose
  reading of the checkpoint is the manifest-checked, restricted one of `mrl.checkpoint.trust`)
  and the job's rollout engine, rewarder and tokenizer on one rank.
- `evaluate`: the training loop's validation (`mrl.train.evaluate.evaluate`) on that session.
- `generate`: responses to given prompts or the job's own data, scored with the job's reward, as JSONL or parquet.
"""
