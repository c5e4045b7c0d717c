"""The multimodal Gemma 3 (`gemma3`: Gemma3ForConditionalGeneration) on mrl's VLM path.

Gemma 3 4B/12B/27B are a SigLIP vision tower, a projector and Gemma 3's text model
(`mrl.models.gemma3`). What differs from the Qwen-VL models (`mrl.models.vlm`):

- positions are plain RoPE ids (no mRoPE): an image's tokens count on like text;
- every image is one fixed-size picture (`vision_config.image_size`) whose patch features are
  average-pooled to `mm_tokens_per_image` tokens, normed (Gemma's `(1 + w)` RMSNorm) and
  projected (`Gemma3MultiModalProjector`); the tower and projector are `transformers`' own
  modules, held together by `Gemma3Vision` (megatron names `vision.vision_tower.*`,
  `vision.multi_modal_projector.*`; the checkpoint's `vision_tower.*` / `multi_modal_projector.*`
  and `language_model.model.*`, `mrl.weights.tables`);
- the tokens of one image attend to each other both ways (`transformers`' `token_type_ids` /
  `block_sequence_ids`: a run of image tokens is one block), text stays causal, and sliding-window
  layers keep their window on top: `image_blocks` gives each token its block id, which the
  language model hangs on the packed row's `PackedSeqParams` for mrl's attention
  (`mrl.models.attention.sdpa_packed`).

The flat config (`mrl.models.vlm`) keeps the text config's fields at the top level, the VLM's
own fields (`image_token_index`, `boi_token_index`, `eoi_token_index`, `mm_tokens_per_image`)
and their `*_token_id` aliases (`transformers`' attribute map), so every placeholder check reads
them as for Qwen-VL.
"""
from __future__ import annotations

from typing import Any

import torch

#: the VLM's own top-level fields of a Gemma 3 config.json
TOP = ("image_token_index", "boi_token_index", "eoi_token_index", "mm_tokens_per_image", "tie_word_embeddings",
       "initializer_range")
#: flat-form aliases of the token fields (`transformers`' `Gemma3Config.attribute_map`)
ALIASES = {"image_token_id": "image_token_index", "boi_token_id": "boi_token_index",
           "eoi_token_id": "eoi_token_index"}
#: `transformers`' defaults for the fields above (Gemma3Config)
DEFAULTS = dict(mm_tokens_per_image=256, boi_token_index=255_999, eoi_token_index=256_000,
                image_token_index=262_144)


def flatten(cfg: dict[str, Any]) -> dict[str, Any]:
    """mrl's flat form of a Gemma 3 `config.json`: the text model's fields (its per-layer-type
    `rope_parameters` untouched), the VLM fields and their aliases, `vision_config`."""
    own = set(TOP) | set(ALIASES) | {"vision_config", "model_type", "text_config"}
    text = dict(cfg["text_config"] if cfg.get("text_config") else {k: v for k, v in cfg.items() if k not in own})
    text.pop("model_type", None)
    top = {k: cfg[k] for k in TOP if cfg.get(k) is not None}
    for alias, field in ALIASES.items():
        if cfg.get(alias) is not None:
            top.setdefault(field, cfg[alias])
    for k, v in DEFAULTS.items():
        top.setdefault(k, v)
    out = {**text, **top, "model_type": "gemma3", "vision_config": dict(cfg.get("vision_config") or {})}
    out.update({alias: out[field] for alias, field in ALIASES.items() if field in out})
    return out


def nested(hf: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face `config.json` form of the flat config."""
    own = set(TOP) | set(ALIASES) | {"vision_config", "model_type"}
    text = {k: v for k, v in hf.items() if k not in own}
    vision = {k: v for k, v in hf["vision_config"].items() if k != "model_type"}
    return {"model_type": "gemma3", "text_config": {**text, "model_type": "gemma3_text"},
            "vision_config": {**vision, "model_type": "siglip_vision_model"}, **{k: hf[k] for k in TOP if k in hf}}


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The flat config as a `gemma3_text` config (what `transformers`' RoPE helpers read)."""
    own = set(TOP) | set(ALIASES) | {"vision_config"}
    return {**{k: v for k, v in hf.items() if k not in own}, "model_type": "gemma3_text"}


class Gemma3Vision(torch.nn.Module):
    """`transformers`' SigLIP tower and Gemma 3's projector: `[N, 3, S, S]` pixels -> the image
    tokens' embeddings `[N x mm_tokens_per_image, hidden]`, images in order."""

    def __init__(self, config):
        from transformers import AutoModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        super().__init__()
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)
        # transformers starts the projection at zeros (a checkpoint fills it); a random preset would
        # then never see its images, with the tower frozen: drawn like the text model's weights
        torch.nn.init.normal_(self.multi_modal_projector.mm_input_projection_weight,
                              std=float(getattr(config, "initializer_range", 0.02) or 0.02))

    def forward(self, pixel_values: torch.Tensor, grid_thw=None) -> torch.Tensor:
        dtype = next(self.multi_modal_projector.parameters()).dtype
        hidden = self.vision_tower(pixel_values=pixel_values.to(dtype)).last_hidden_state
        feats = self.multi_modal_projector(hidden)
        return feats.reshape(-1, feats.shape[-1])


def vision_module(config, dtype, device=None) -> torch.nn.Module:
    """`Gemma3Vision` for the `transformers` config object `config`, random (the checkpoint
    import fills it), in `dtype`; on the meta device when `device` is "meta"."""
    if device == "meta":
        with torch.device("meta"):
            return Gemma3Vision(config).to(dtype) if dtype is not None else Gemma3Vision(config)
    module = Gemma3Vision(config)
    return module.to(dtype) if dtype is not None else module


def image_blocks(input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """Each token's image block `[..., S]` int64: -1 for text, else the index (over the whole
    tensor, row-major) of the run of consecutive `image_token_id` tokens it belongs to - the
    tokens of one image, which attend to each other both ways (`transformers`'
    `get_block_sequence_ids_for_mask`, numbered over the row instead of per batch row)."""
    flat = input_ids.reshape(-1)
    is_image = flat == image_token_id
    prev = torch.nn.functional.pad(is_image, (1, 0))[:-1]
    if input_ids.dim() > 1:   # a run never continues across batch rows
        prev = prev.view_as(input_ids).clone()
        prev[..., 0] = False
        prev = prev.reshape(-1)
    start = is_image & ~prev
    ids = torch.cumsum(start.to(torch.long), 0) - 1
    return torch.where(is_image, ids, torch.full_like(ids, -1)).view_as(input_ids)


def block_mask(blocks: torch.Tensor, window: int | None) -> torch.Tensor:
    """`[L, L]` bool for one sequence's block ids `[L]`: query i sees key j when j <= i or both are
    in the same image block, and (sliding layers, megatron's `window`: transformers'
    `sliding_window - 1`) j >= i - window - transformers' `AND(sliding_window, OR(causal, blockwise))`."""
    i = torch.arange(blocks.shape[0], device=blocks.device)
    diff = i[:, None] - i[None, :]
    same = (blocks[:, None] == blocks[None, :]) & (blocks[:, None] >= 0)
    allowed = (diff >= 0) | same
    if window is not None:
        allowed &= diff <= window
    return allowed


#: the tiny preset's image processor: 56x56 pixels (4x4 patches of 14, pooled to 2x2 = 4 tokens)
TINY_IMAGE_SIZE = 56


def image_processor(hf: dict[str, Any]):
    """`transformers`' Gemma 3 image processor at the tower's image size (a preset has no
    `preprocessor_config.json`)."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    size = int(hf["vision_config"].get("image_size") or TINY_IMAGE_SIZE)
    return Gemma3ImageProcessorPil(size={"height": size, "width": size}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
