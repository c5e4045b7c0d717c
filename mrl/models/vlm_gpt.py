"""megatron-core's GPTModel with multimodal RoPE and the Hugging Face vision tower (`mrl.models.vlm`).

`VisionLanguageGPT` is a `GPTModel` (so every megatron and mrl code path that takes one takes it):
its rotary module is megatron's `MultimodalRotaryEmbedding` with the checkpoint's inverse
frequencies, its position ids are `[3, B, S]` (a `[B, S]` tensor means text only: the same id in
each section), and on the first pipeline stage `pixel_values` / `image_grid_thw` go through the
frozen tower whose features replace the image placeholders' embeddings.
"""
from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.common.embeddings import MultimodalRotaryEmbedding
from megatron.core.models.gpt import GPTModel


class HFMultimodalRotaryEmbedding(MultimodalRotaryEmbedding):
    """megatron's mRoPE module with given inverse frequencies (megatron's constructor allocates
    them on a CUDA device; this one keeps them where they are given)."""

    def __init__(self, inv_freq: torch.Tensor):
        torch.nn.Module.__init__(self)
        self.rotary_interleaved = False
        self.seq_len_interpolation_factor = None
        self.inv_freq = inv_freq
        from megatron.core import parallel_state as ps

        self.cp_group = ps.get_context_parallel_group(check_initialized=False)


class VisionLanguageGPT(GPTModel):
    """A VLM's language model (megatron) with its vision tower (`transformers`) on the first stage.

    Built as a RoPE GPTModel, then switched to mRoPE: same layers, one rotary module swapped."""

    def __init__(self, *, hf: dict[str, Any], inv_freq: torch.Tensor, **kwargs):
        from mrl.models.vlm import mrope_section, vision_tower

        super().__init__(position_embedding_type="rope", **kwargs)
        device = self.rotary_pos_emb.inv_freq.device
        self.position_embedding_type = "mrope"
        self.mrope_section = mrope_section(hf)
        self.rotary_pos_emb = HFMultimodalRotaryEmbedding(inv_freq.to(device))
        self.image_token_id = int(hf["image_token_id"])
        from mrl.models.vlm import PLACEHOLDER_FIELDS

        self.banned = sorted({int(hf[f]) for f in PLACEHOLDER_FIELDS if hf.get(f) is not None and hf[f] < hf["vocab_size"]})
        self.vision = None
        if self.pre_process:
            self.vision = vision_tower(hf, self.config.params_dtype).to(device)
            self.vision.requires_grad_(False)   # frozen: megatron's DDP and the optimizer skip it

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, *args,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None, **kwargs):
        if position_ids is not None and position_ids.dim() == 2:
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        if decoder_input is None and self.pre_process and pixel_values is not None:
            decoder_input = self.embed_with_images(input_ids, position_ids, pixel_values, image_grid_thw)
        out = super().forward(input_ids, position_ids, attention_mask, decoder_input, *args, **kwargs)
        if self.post_process and kwargs.get("labels") is None and self.banned:
            out = self.ban_placeholders(out)
        return out

    def ban_placeholders(self, logits: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel logits `[..., V / TP]` with the vision placeholders at -1e9: the policy the
        rollout samples from never emits them (`mrl.rollout.hf`), so its log-probs are over the rest
        (finite, so an entropy's p log p is 0 there, not NaN)."""
        from megatron.core import parallel_state as ps

        width = logits.shape[-1]
        lo = ps.get_tensor_model_parallel_rank() * width
        local = [t - lo for t in self.banned if lo <= t < lo + width]
        if not local:
            return logits
        mask = torch.zeros(width, dtype=torch.bool, device=logits.device)
        mask[local] = True
        return logits.masked_fill(mask, -1e9)

    def embed_with_images(self, input_ids: torch.Tensor, position_ids: torch.Tensor, pixel_values: torch.Tensor,
                          image_grid_thw: torch.Tensor) -> torch.Tensor:
        """megatron's embedding output (`[S, B, H]`, sequence-parallel scattered when on) with the
        image placeholders' rows replaced by the tower's merged features, in order."""
        from megatron.core import tensor_parallel

        emb = self.embedding(input_ids=input_ids, position_ids=position_ids)
        with torch.no_grad():
            feats = self.vision(pixel_values.to(self.config.params_dtype), grid_thw=image_grid_thw).pooler_output
        mask = input_ids == self.image_token_id                            # [B, S]: images in row order
        if int(mask.sum()) != feats.shape[0]:
            raise ValueError(f"image features and image tokens do not match: {int(mask.sum())} placeholder "
                             f"tokens, {feats.shape[0]} features")
        full = torch.zeros(mask.shape + (feats.shape[-1],), dtype=emb.dtype, device=emb.device)
        full[mask] = feats.to(emb.dtype)
        full = full.transpose(0, 1).contiguous()                           # [S, B, H] as megatron's embedding
        keep = (~mask).transpose(0, 1).unsqueeze(-1).to(emb.dtype)
        if self.config.sequence_parallel:
            full = tensor_parallel.scatter_to_sequence_parallel_region(full)
            keep = tensor_parallel.scatter_to_sequence_parallel_region(keep)
        return emb * keep + full
