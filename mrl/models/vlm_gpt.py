"""megatron-core's GPTModel with multimodal RoPE and the Hugging Face vision tower (`mrl.models.vlm`).

`VisionLanguageGPT` is a `GPTModel` (so every megatron and mrl code path that takes one takes it):
its rotary module is megatron's `MultimodalRotaryEmbedding` with the checkpoint's inverse
frequencies (Qwen3-VL's sections interleaved), its position ids are `[3, B, S]` (a `[B, S]` tensor
means text only: the same id in each section), and on the first pipeline stage `pixel_values` /
`image_grid_thw` go through the tower whose features replace the image placeholders' embeddings.
Qwen3-VL's deepstack features are added to the image tokens' hidden states after the first decoder
layers (forward hooks on those layers, which must all be on the first stage).

The multimodal Gemma 3 (`mrl.models.gemma3_vlm`) keeps megatron's plain RoPE (its model builder
sets Gemma's local/global tables) and `[B, S]` position ids; its tower and projector give the image
tokens' embeddings, and each image's tokens attend to each other both ways: the forward hangs the
row's image blocks on its `PackedSeqParams` (`mrl_image_blocks`), which mrl's core attention reads.

The tower is frozen unless `set_vision_trainable` (the job's `actor.vision.trainable`) turns it on:
then it runs with autograd, megatron's DDP and optimizer take its parameters like any replicated
parameter, and its gradients are averaged over the tensor-parallel group (megatron's
`average_gradients_across_tp_domain`, which `finalize_model_grads` reads), so the replicas stay equal.
"""
from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.common.embeddings import MultimodalRotaryEmbedding
from megatron.core.models.gpt import GPTModel


class HFMultimodalRotaryEmbedding(MultimodalRotaryEmbedding):
    """megatron's mRoPE module with given inverse frequencies (megatron's constructor allocates
    them on a CUDA device; this one keeps them where they are given)."""

    def __init__(self, inv_freq: torch.Tensor, interleaved_sections: bool = False):
        torch.nn.Module.__init__(self)
        self.rotary_interleaved = False
        self.seq_len_interpolation_factor = None
        self.inv_freq = inv_freq
        self.interleaved_sections = interleaved_sections
        from megatron.core import parallel_state as ps

        self.cp_group = ps.get_context_parallel_group(check_initialized=False)

    def forward(self, position_ids: torch.Tensor, mrope_section: list[int], cp_group=None) -> torch.Tensor:
        if not self.interleaved_sections:
            return super().forward(position_ids, mrope_section, cp_group=cp_group)
        return interleaved_mrope_angles(position_ids, self.inv_freq, mrope_section)


def interleaved_mrope_angles(position_ids: torch.Tensor, inv_freq: torch.Tensor, section: list[int]) -> torch.Tensor:
    """Qwen3-VL's mRoPE angles `[S, B, 1, 2F]` (megatron's layout) for ids `[3, B, S]`: frequency `j`
    takes the height id where `j % 3 == 1` and `j < 3 * section[1]`, the width id where
    `j % 3 == 2` and `j < 3 * section[2]`, the temporal id elsewhere (`transformers`'
    `recomposition_frequencies`); the halves repeat (rotate_half)."""
    freqs = position_ids.to(inv_freq.device).float()[..., None] * inv_freq.float()   # [3, B, S, F]
    axis = torch.zeros(freqs.shape[-1], dtype=torch.long, device=freqs.device)
    for dim in (1, 2):
        axis[dim: section[dim] * 3: 3] = dim
    picked = freqs.gather(0, axis.view(1, 1, 1, -1).expand(1, *freqs.shape[1:]))[0]   # [B, S, F]
    emb = torch.cat((picked, picked), dim=-1)
    return emb[..., None, :].transpose(0, 1).contiguous()


class VisionLanguageGPT(GPTModel):
    """A VLM's language model (megatron) with its vision tower (`transformers`) on the first stage.

    Built as a RoPE GPTModel, then switched to mRoPE: same layers, one rotary module swapped."""

    def __init__(self, *, hf: dict[str, Any], inv_freq: torch.Tensor, **kwargs):
        from mrl.models.vlm import (PLACEHOLDER_FIELDS, deepstack_layers, mrope_interleaved, mrope_section, uses_mrope,
                                    vision_tower)

        super().__init__(position_embedding_type="rope", **kwargs)
        device = self.rotary_pos_emb.inv_freq.device
        self.mrope = uses_mrope(hf)
        if self.mrope:
            self.position_embedding_type = "mrope"
            self.mrope_section = mrope_section(hf)
            self.rotary_pos_emb = HFMultimodalRotaryEmbedding(inv_freq.to(device), mrope_interleaved(hf))
        else:   # plain RoPE with the checkpoint's frequencies (Gemma 3: its model builder adds the local table)
            self.rotary_pos_emb.inv_freq = inv_freq.to(device)
        #: Gemma 3: image tokens attend to their own image both ways (`gemma3_vlm.image_blocks`)
        self.bidirectional_images = hf["model_type"] == "gemma3"
        self.image_token_id = int(hf["image_token_id"])
        self.banned = sorted({int(hf[f]) for f in PLACEHOLDER_FIELDS if hf.get(f) is not None and hf[f] < hf["vocab_size"]})
        self.vision = None
        self.vision_trainable = False
        self._deepstack: list[torch.Tensor] | None = None   # this forward's deepstack features ([S, B, H] each)
        deep = deepstack_layers(hf)
        if deep and self.pre_process:
            self._hook_deepstack(deep)
        if self.pre_process:
            self.vision = vision_tower(hf, self.config.params_dtype).to(device)
            self.vision.requires_grad_(False)   # frozen: megatron's DDP and the optimizer skip it

    def _hook_deepstack(self, deep: int) -> None:
        """After global decoder layer k < `deep`, the k-th deepstack feature is added (zero on text tokens)."""
        from mrl.errors import UserError

        here = {layer.layer_number - 1: layer for layer in self.decoder.layers}
        missing = [k for k in range(deep) if k not in here]
        if missing:
            raise UserError(f"parallel.pipeline: the first pipeline stage holds decoder layers {sorted(here)}, but "
                            f"the vision tower's deepstack features enter layers 0-{deep - 1} (fewer pipeline stages "
                            "are needed)")

        def hook(k):
            def add(module, args, output):
                if self._deepstack is None:
                    return output
                if isinstance(output, tuple):
                    return (output[0] + self._deepstack[k],) + tuple(output[1:])
                return output + self._deepstack[k]
            return add

        for k in range(deep):
            here[k].register_forward_hook(hook(k))

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, *args,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None, **kwargs):
        if self.mrope and position_ids is not None and position_ids.dim() == 2:
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        if self.bidirectional_images:   # (every stage gets the row's images)
            self._mark_image_blocks(input_ids, kwargs.get("packed_seq_params"), pixel_values is not None)
        self._deepstack = None
        if decoder_input is None and self.pre_process and pixel_values is not None:
            decoder_input = self.embed_with_images(input_ids, position_ids, pixel_values, image_grid_thw)
        try:
            out = super().forward(input_ids, position_ids, attention_mask, decoder_input, *args, **kwargs)
        finally:
            self._deepstack = None
        if self.post_process and kwargs.get("labels") is None and self.banned:
            out = self.ban_placeholders(out)
        return out

    def _mark_image_blocks(self, input_ids: torch.Tensor, packed_seq_params, images: bool) -> None:
        """Hang the row's image blocks (`gemma3_vlm.image_blocks`, `[T]`) on its `PackedSeqParams` for
        mrl's attention when the row comes with its images (`transformers` reads `token_type_ids` only
        when given: placeholder ids without images are plain causal text). Rows with images must be packed."""
        from mrl.models.gemma3_vlm import image_blocks

        if packed_seq_params is not None:
            packed_seq_params.mrl_image_blocks = None
        if not images or input_ids is None or not bool((input_ids == self.image_token_id).any()):
            return
        if packed_seq_params is None:
            raise ValueError("gemma3: a row with image tokens must be packed (PackedSeqParams): mrl's attention "
                             "reads its images' bidirectional blocks from there")
        packed_seq_params.mrl_image_blocks = image_blocks(input_ids.reshape(-1), self.image_token_id)

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
        image placeholders' rows replaced by the tower's merged features, in order; the deepstack
        features (Qwen3-VL) laid out alike for the hooked layers."""
        from megatron.core import tensor_parallel

        emb = self.embedding(input_ids=input_ids, position_ids=position_ids)
        with torch.set_grad_enabled(self.vision_trainable and torch.is_grad_enabled()):
            out = self.vision(pixel_values.to(self.config.params_dtype), grid_thw=image_grid_thw)
        feats = out if isinstance(out, torch.Tensor) else out.pooler_output   # Gemma 3's: the projected tokens
        mask = input_ids == self.image_token_id                            # [B, S]: images in row order
        if int(mask.sum()) != feats.shape[0]:
            raise ValueError(f"image features and image tokens do not match: {int(mask.sum())} placeholder "
                             f"tokens, {feats.shape[0]} features")

        def at_images(f: torch.Tensor) -> torch.Tensor:   # [B, S, H] zeros with f in the image rows -> [S, B, H]
            full = torch.zeros(mask.shape + (f.shape[-1],), dtype=emb.dtype, device=emb.device)
            full = full.masked_scatter(mask.unsqueeze(-1), f.to(emb.dtype))
            full = full.transpose(0, 1).contiguous()                       # [S, B, H] as megatron's embedding
            return tensor_parallel.scatter_to_sequence_parallel_region(full) if self.config.sequence_parallel else full

        keep = (~mask).transpose(0, 1).unsqueeze(-1).to(emb.dtype)
        if self.config.sequence_parallel:
            keep = tensor_parallel.scatter_to_sequence_parallel_region(keep)
        deep = getattr(out, "deepstack_features", None)
        if deep:
            self._deepstack = [at_images(f) for f in deep]
        return emb * keep + at_images(feats)


def set_vision_trainable(chunks: list, trainable: bool) -> int:
    """Turn the tower of each chunk (first stage only) trainable or frozen; the number of tower
    parameters now trained on this rank. Call before megatron's DDP wraps the chunks (it buckets
    the parameters that require gradients)."""
    n = 0
    for chunk in chunks:
        model = getattr(chunk, "module", chunk)
        if isinstance(model, VisionLanguageGPT) and model.vision is not None:
            model.vision_trainable = trainable
            model.vision.requires_grad_(trainable)
            for p in model.vision.parameters():
                p.average_gradients_across_tp_domain = trainable
            n += sum(p.numel() for p in model.vision.parameters()) if trainable else 0
    return n
