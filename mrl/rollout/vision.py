"""Image prompts for vLLM: collapsed placeholders in, the expanded prompt checked on the way out.

mrl's prompt ids hold each image as `<|vision_start|>`, one `<|image_pad|>` per merged patch, and
`<|vision_end|>` (`mrl.data.images`): the form the trainer and the hf engine run. vLLM expands
placeholders itself: for a token-id prompt with `multi_modal_data` it replaces every
`<|image_pad|>` by as many pads as its own processor gives the image, so an already expanded
prompt would be expanded again. The engine therefore gets each image's run of pads collapsed to
one pad, and the images the data processor kept (`ImageInputs.images`, already at the size the
processor resizes to, so vLLM's processor computes the same grids). Token in, token out: what
vLLM generated from is the expanded prompt, which `check_expanded` compares with mrl's own ids,
so the trainer's token ids and mRoPE positions are those of the engine's forward.

The placeholders are never sampled (verl #3469/#7038: a sampled placeholder breaks the next
forward); vLLM gets the rest of the vocabulary as `allowed_token_ids` (the banned tokens'
logits become -inf before sampling and before the log-probs, as the trainer's -1e9).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from mrl.errors import UserError


def collapse_image_pads(ids: Sequence[int], pad_id: int, tokens_per_image: Sequence[int]) -> list[int]:
    """`ids` with each run of `pad_id` (one per image, in order) collapsed to one pad. A run whose
    length is not its image's token count, or a run count that is not the image count, is an
    error: the prompt and its images no longer pair up."""
    out: list[int] = []
    runs: list[int] = []
    for t in ids:
        if t == pad_id:
            if out and out[-1] == pad_id:
                runs[-1] += 1
                continue
            runs.append(1)
        out.append(int(t))
    if tuple(runs) != tuple(tokens_per_image):
        raise UserError(f"rollout: a prompt's image placeholders ({len(runs)} run(s) of {runs} pad tokens) do not "
                        f"match its {len(tokens_per_image)} image(s) of {list(tokens_per_image)} tokens")
    return out


def vllm_prompt(ids: Sequence[int], images: Any, pad_id: int) -> dict:
    """vLLM's prompt for `ids` and its `ImageInputs` (None: a text prompt, passed as it is)."""
    if images is None or not images.tokens_per_image:
        return {"prompt_token_ids": list(ids)}
    if len(images.images) != len(images.tokens_per_image):
        raise UserError("rollout: a prompt's images were not kept for vLLM (ImageInputs.images is empty: built "
                        "without mrl.data.images.ImageProcessor.process?)")
    return {"prompt_token_ids": collapse_image_pads(ids, pad_id, images.tokens_per_image),
            "multi_modal_data": {"image": list(images.images)}}


def check_expanded(engine_ids: Optional[Sequence[int]], ids: Sequence[int]) -> None:
    """vLLM's expanded prompt must be mrl's: otherwise the trainer would score other tokens (and
    other positions) than the engine generated from. A mismatch means vLLM's processor gave an
    image another grid (a different `preprocessor_config.json` than the data's)."""
    if engine_ids is None or list(engine_ids) == list(ids):
        return
    raise UserError(f"rollout: vLLM expanded an image prompt to {len(engine_ids)} tokens, the data to {len(ids)}: "
                    "its image processor sizes the images differently (model.path's preprocessor_config.json)")


def allowed_token_ids(vocab_size: int, banned: Sequence[int]) -> Optional[list[int]]:
    """The vocabulary without `banned` (None when nothing is banned)."""
    if not banned:
        return None
    drop = set(int(b) for b in banned)
    return [i for i in range(vocab_size) if i not in drop]


def vlm_facts(model_path: str) -> Optional[dict]:
    """(pad id, banned placeholder ids, vocab size) of a vision-language checkpoint, else None."""
    from mrl.models.facts import find_hf_config
    from mrl.models.vlm import PLACEHOLDER_FIELDS, is_vlm

    found = find_hf_config(model_path)
    if found is None or not is_vlm(found[0]):
        return None
    hf = found[0]   # a VLM's flat form (mrl.models.vlm.flatten)
    banned = [int(hf[f]) for f in PLACEHOLDER_FIELDS if hf.get(f) is not None and int(hf[f]) < int(hf["vocab_size"])]
    return {"pad_id": int(hf["image_token_id"]), "banned": banned, "vocab_size": int(hf["vocab_size"])}
