"""The `model` section: which checkpoint the actor (and by default critic and reference) start from."""
from __future__ import annotations

from typing import Literal, Optional

from mrl.models.facts import BUILTIN_PRESETS, architectures_help
from mrl.schema.section import option, section


@section
class ModelConfig:
    """The policy model. `path` is a local Hugging Face directory, a Hub id, or `builtin:<preset>`."""

    path: str = option(help="HF model directory, Hub id, or builtin:<preset> (tiny random models for CPU runs: "
                            f"{', '.join(BUILTIN_PRESETS)}). Model types, with the layouts tested against "
                            f"transformers: {architectures_help()}")
    dtype: Literal["bfloat16", "float16", "float32"] = option("bfloat16", help="parameter/compute dtype")
    tokenizer: Optional[str] = option(None, help="tokenizer directory or id (default: model.path)")
    trust_remote_code: bool = option(False, help="allow custom modelling code from the checkpoint")
    use_fused_kernels: bool = option(True, help="Triton log-prob/entropy kernels and megatron's compiled SwiGLU "
                                     "on cuda; false runs the torch twins (reference runs, debugging). "
                                     "cpu always runs the twins")
    attention: Literal["auto", "te", "varlen", "sdpa", "flex"] = option(
        "auto", help="core attention on packed sequences: te (Transformer Engine), varlen (torch flash, cuda), "
                     "sdpa (per-sequence scaled_dot_product_attention), flex (flex_attention, document mask); "
                     "auto = te if installed on cuda, else varlen on cuda, sdpa on cpu")


@section
class VisionConfig:
    """A vision-language model's vision tower (`mrl.models.vlm_gpt`)."""

    trainable: bool = option(False, help="train the vision tower with the language model (gradients averaged over "
                                         "tensor parallelism, optimizer state, checkpoints and weight sync include "
                                         "it); false: frozen. Vision-language models only")
