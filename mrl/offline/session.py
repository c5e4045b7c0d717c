"""A checkpoint's policy on one rank: the job's rollout engine over the checkpoint's weights, its
rewarder and tokenizer, as the training loop's `Run` and `Generation` parts.

The weights go through `mrl merge` into a temporary Hugging Face directory (merge checks the
step directory against its manifest and reads its pickled files with the restricted readers of
`mrl.checkpoint.trust`), and the engine is built from it exactly as training builds it from
`model.path`. The job is run on one process: one rank, no model parallelism, colocated.
"""
from __future__ import annotations

import dataclasses
import logging
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from mrl.offline.target import Target


def single_rank(spec):
    """`spec` laid out on one process (one node, one rank, no model parallelism, colocated rollout)."""
    from mrl.platform.config import ParallelConfig

    return dataclasses.replace(
        spec, platform=dataclasses.replace(spec.platform, nodes=1, ranks_per_node=1),
        parallel=ParallelConfig(distributed_optimizer=False),
        rollout=dataclasses.replace(spec.rollout, placement="colocated", ranks=0))


@contextmanager
def hf_weights(target: Target) -> Iterator[str]:
    """The `model.path` the engine loads: the checkpoint merged into a temporary HF directory
    (removed afterwards), or the job's own `model.path` when there is no checkpoint."""
    if target.checkpoint is None:
        yield target.spec.model.path
        return
    from mrl.merge import merge
    from mrl.models.facts import builtin_preset, find_hf_config

    logging.getLogger("mrl.merge").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="mrl-weights-") as tmp:
        out = Path(tmp) / "hf"
        merge(target.checkpoint, out, verify=False)
        preset = find_hf_config(target.spec.model.path) if builtin_preset(target.spec.model.path) else None
        if preset is not None:
            stop_as_training(out, preset[0].get("eos_token_id"))
        yield str(out)


def stop_as_training(out: Path, eos) -> None:
    """Give the merged directory `out` of a builtin preset the EOS its training engine had, `eos`
    (the preset's config's; none for the shipped presets, whose responses run to max_tokens).

    Why: `mrl merge` writes the byte tokenizer's EOS (256) into the config and generation config
    of a builtin preset, for Hugging Face users of the output, while training built the engine
    from the preset's own config. An engine loading the merged directory stopped responses at
    token 256 where the training loop's went on, so `mrl eval` scored other responses than the
    run's validation had (quickstart step 2: 0.0586 vs 0.0625, the tokens and log-probs otherwise
    bit for bit equal). Both engines read the EOS from these two files."""
    import json

    def same(cfg: dict) -> dict:
        cfg = {k: same(v) if isinstance(v, dict) else v for k, v in cfg.items() if k != "eos_token_id"}
        return {**cfg, "eos_token_id": eos} if eos is not None else cfg

    path = out / "config.json"
    path.write_text(json.dumps(same(json.loads(path.read_text())), indent=2) + "\n")
    (out / "generation_config.json").unlink(missing_ok=True)   # else transformers and vLLM read its EOS first


@contextmanager
def session(target: Target) -> Iterator[tuple]:
    """`(run, generation, reward model engine or None)` of `target` on this one process; the platform and the engine are
    torn down on exit."""
    from mrl import platform
    from mrl.models.megatron import hf_config
    from mrl.models.tokenizer import load_tokenizer
    from mrl.train.build import build_reward_model, build_generation, close
    from mrl.train.parts import Run
    from mrl.train.plan import step_plan

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()   # "Loading weights" bars of the temporary directory
    tokenizer = load_tokenizer(target.spec.model)   # the job's tokenizer, whatever the weights' directory holds
    with hf_weights(target) as weights:
        spec = single_rank(target.spec)
        spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, path=weights))
        ctx = platform.setup(spec.platform, spec.parallel, seed=spec.job.seed, env={})
        gen = None
        try:
            from mrl.data.images import model_image_processor

            hf = hf_config(spec.model)
            # a vision-language model's processor (the merged directory holds its preprocessor config)
            run = Run(spec=spec, ctx=ctx, hf=hf, tokenizer=tokenizer, total_steps=target.step, plan=step_plan(spec),
                      images=model_image_processor(spec.model.path, hf))
            reward_model = build_reward_model(spec, run.hf, ctx.platform)   # when a reward source is a model
            gen = build_generation(spec, run.plan, ctx, tokenizer, reward_model=reward_model)
            gen.version = target.step
            yield run, gen, reward_model
        finally:
            close(gen)
            platform.teardown()
