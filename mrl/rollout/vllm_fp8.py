"""vLLM's quantization config for the block-FP8 weight stream (`rollout.quantization = "fp8"`,
`mrl/weights/fp8.py`): what `engine_args` passes as `hf_overrides.quantization_config`, so vLLM
creates FP8 `weight` and `weight_scale_inv` parameters that the stream's tensors load into."""
from __future__ import annotations

from mrl.weights.fp8 import from_config


def vllm_quantization_config(rollout, model_path: str) -> dict:
    """vLLM's `quantization_config` for the block-FP8 stream of `rollout.fp8`: 128x128 weight
    blocks, dynamic activation scales, and as `ignored_layers` the linear modules the skip list
    keeps in the export dtype (routers by default; read from the model's config when it is known)."""
    from mrl.models.facts import known_hf_config
    from mrl.weights.sync_plan import hf_tensors

    stream = from_config(rollout)
    found = known_hf_config(model_path)
    ignored = stream.ignored_modules((t.name, t.shape) for t in hf_tensors(found[0])) if found else []
    return stream.vllm_config(ignored)

