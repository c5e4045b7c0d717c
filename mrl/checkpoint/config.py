"""The `checkpoint` section: atomic saves and resumes that say what they did."""
from __future__ import annotations

from typing import Literal, Optional

from mrl.schema.section import option, section


@section
class CheckpointConfig:
    """Megatron distributed checkpoints of actor/critic/optimizer/sampler state."""

    dir: Optional[str] = option(None, help="checkpoint directory (default: <job.output_dir>/<job.name>/checkpoints)")
    every_steps: int = option(0, ge=-1, help="save every N steps; 0 = only at the end; -1 = never (verl's save_freq -1)")
    keep_last: int = option(3, ge=1, help="checkpoints kept")
    resume: Literal["auto", "never", "must"] = option("auto", help="auto: latest if any; must: error if none; never: start fresh")
    load_from: Optional[str] = option(None, help="a specific checkpoint to resume from")
    save_optimizer: bool = option(True, help="include optimizer state")
    save_hf_at_end: bool = option(False, help="also export Hugging Face safetensors at the end")


def saves_at(step: int, every: int, total: int) -> bool:
    """Whether step `step` of `total` is saved: every `every` steps and at the last one; never when
    `every` is -1."""
    if every < 0:
        return False
    return (every > 0 and step % every == 0) or step == total
