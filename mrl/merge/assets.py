"""Everything in the output directory besides the weights: config, generation config, tokenizer.

- `config.json`: the checkpoint's own HF config (as the training job read it), with the output
  dtype; a critic or reward model is described as its base model (`*Model`), because its head is
  a value head stored separately in `value_head.safetensors`, not an LM head.
- a vision-language model's processor files (`preprocessor_config.json` ...), copied or, for the
  tiny preset, written from its image processor;
- tokenizer files and `generation_config.json`: copied from the job's `model.tokenizer` /
  `model.path` when that is a local Hugging Face directory; for `builtin:` presets the byte-level
  tokenizer mrl trains them with is written, and the config's special-token ids point into it.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import torch

from mrl.models.facts import builtin_preset

# Tokenizer files `transformers` and the common tokenizer formats use.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                   "chat_template.jinja", "chat_template.json")
TOKENIZER_GLOBS = ("*.tiktoken",)
GENERATION_CONFIG = "generation_config.json"


def _local_dir(source: Optional[str]) -> Optional[Path]:
    if not source or builtin_preset(source) is not None:
        return None
    path = Path(source)
    return path if path.is_dir() else None


def _hub_snapshot(source: Optional[str], filename: str) -> Optional[Path]:
    """The directory of a cached Hub id's `filename` (never downloads)."""
    if not source or builtin_preset(source) is not None or Path(source).exists() or "/" not in source:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(source, filename)
    except Exception:  # noqa: BLE001 - a malformed id is simply not cached
        return None
    return Path(found).parent if isinstance(found, str) else None


def write_config(out: Path, hf: dict[str, Any], *, dtype: torch.dtype, valued: bool,
                 special_ids: Optional[dict[str, Optional[int]]] = None) -> None:
    """`config.json` for the merged model."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    # a checkpoint dequantized on load (gpt-oss' MXFP4) is written unquantized: no quantization_config
    cfg = {k: v for k, v in hf.items() if k not in ("transformers_version", "torch_dtype", "dtype", "quantization_config")}
    from mrl.models.vlm import hf_config_object, is_vlm

    if is_vlm(cfg):   # the nested config.json transformers and vLLM read, its text ids in the text config
        cfg.update(special_ids or {})
        config = hf_config_object(cfg)
        config.architectures = [type(config).__name__.replace("Config", "ForConditionalGeneration")]
        config.dtype = dtype
        config.save_pretrained(out)
        return
    model_type = cfg["model_type"]
    names = MODEL_MAPPING_NAMES if valued else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    cfg["architectures"] = [names[model_type]]
    if valued:
        cfg["tie_word_embeddings"] = False  # a value model has no LM head to tie
    if cfg.get("num_nextn_predict_layers"):
        cfg["num_nextn_predict_layers"] = 0   # MTP layers are not trained or written (weights.hf_import.mtp_tensors)
    cfg.update(special_ids or {})
    config = AutoConfig.for_model(**cfg)
    config.dtype = dtype
    config.save_pretrained(out)


def write_tokenizer(out: Path, source: Optional[str]) -> list[str]:
    """Tokenizer files from `source` into `out`; returns what was written (empty when none found)."""
    if source and builtin_preset(source) is not None:
        from mrl.models.tokenizer import load_tokenizer

        tok = load_tokenizer(SimpleNamespace(tokenizer=None, path=source))   # the preset's byte tokenizer
        return [Path(p).name for p in tok.save_pretrained(str(out))]
    src = _local_dir(source) or _hub_snapshot(source, "tokenizer_config.json")
    if src is None:
        return []
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
            copied.append(name)
    for pattern in TOKENIZER_GLOBS:
        for f in sorted(src.glob(pattern)):
            shutil.copy2(f, out / f.name)
            copied.append(f.name)
    return copied


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def write_processor(out: Path, model_path: Optional[str], hf: dict[str, Any]) -> list[str]:
    """A vision-language model's processor files (verl #4498: a VL checkpoint merged without them
    cannot be used): copied from the model directory, or the tiny preset's image processor."""
    from mrl.models.vlm import is_vlm, tiny_image_processor

    if not is_vlm(hf):
        return []
    if model_path and builtin_preset(model_path) is not None:
        return [Path(p).name for p in tiny_image_processor(hf).save_pretrained(str(out))]
    src = _local_dir(model_path) or _hub_snapshot(model_path, PROCESSOR_FILES[0])
    copied = []
    for name in PROCESSOR_FILES:
        if src is not None and (src / name).is_file():
            shutil.copy2(src / name, out / name)
            copied.append(name)
    return copied


def builtin_special_ids() -> dict[str, Optional[int]]:
    """Special-token ids of the byte-level tokenizer (for the config of a builtin preset)."""
    from mrl.models.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    return {"bos_token_id": None, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}


def write_generation_config(out: Path, model_path: Optional[str], special: Optional[dict]) -> bool:
    """`generation_config.json`: copied from the model directory, or derived from the special-token
    ids for builtin presets. Returns whether one was written."""
    src = _local_dir(model_path) or _hub_snapshot(model_path, GENERATION_CONFIG)
    if src is not None and (src / GENERATION_CONFIG).is_file():
        shutil.copy2(src / GENERATION_CONFIG, out / GENERATION_CONFIG)
        return True
    if special is not None:
        from transformers import GenerationConfig

        GenerationConfig(**{k: v for k, v in special.items() if v is not None}).save_pretrained(out)
        return True
    return False
