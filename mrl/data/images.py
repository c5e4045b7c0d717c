"""Images of a prompt (verl's multimodal layout) -> the model's processor outputs and its placeholder tokens.

verl's multimodal parquet keeps a row's images in an `images` column: a list whose cells are
`{"bytes": ..., "path": ...}` tables (either set), raw bytes, or a path (relative paths against
the parquet file's folder). The prompt marks where each goes: `<image>` in the text, or an
`{"type": "image"}` part in a chat message's content list. The k-th mark takes the k-th image.

The model's image processor (`transformers`: resize to its pixel budget, patchify, normalise)
gives `pixel_values` and `image_grid_thw` once, at load time; they travel with the prompt to
the rollout engine and to the trainer unchanged, so an image is never processed twice
differently. Each mark becomes `<|vision_start|>` + `<|image_pad|>` x (patches / merge^2) +
`<|vision_end|>` in the rendered text (as Qwen2.5-VL's processor expands it), after special-token
escaping, so these are the only vision tokens a prompt can hold.

A row whose images cannot be used is one line naming the row and the reason (undecodable bytes,
a missing file, marks and images that do not pair up), counted in `prompts_bad_image_dropped`.
"""
from __future__ import annotations

import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

IMAGE_COLUMN = "images"
PLACEHOLDER = "<image>"


@dataclass(frozen=True)
class ImageInputs:
    """A prompt's images as the model's processor gives them, in prompt order."""

    pixel_values: Any        # torch.Tensor [patches, channels x temporal x patch x patch]
    image_grid_thw: Any      # torch.Tensor [images, 3]: the patch grid of each image
    tokens_per_image: tuple[int, ...]
    prompt_positions: Any = None   # torch.Tensor [3, prompt tokens]: the model's mRoPE ids of the prompt
    #: the RGB `PIL.Image`s the processor was given, already at the size it keeps (its resize is then
    #: the identity): what vLLM's own processor gets (`mrl.rollout.vision`), so it computes the same grids
    images: tuple = ()


@dataclass(frozen=True)
class VisionTokens:
    """The placeholder tokens' text (a Qwen-VL tokenizer's specials) and the tower's patch merge."""

    start: str = "<|vision_start|>"
    pad: str = "<|image_pad|>"
    end: str = "<|vision_end|>"
    merge_size: int = 2


class BadImage(ValueError):
    """One line: why a row's images cannot be used."""


def image_cells(value: Any) -> list:
    """The image cells of an `images` column value (None / empty: no images)."""
    if value is None:
        return []
    if isinstance(value, (bytes, str, dict)):
        return [value]
    return list(value)


# Untrusted images are bounded before they are decoded: the encoded size (a file is not read past
# it) and the pixel count read from the header (a small file can declare a huge canvas).
# Qwen2.5-VL's processor resizes to at most 12,845,056 pixels; 40M leaves room for any source.
MAX_IMAGE_BYTES = 64 * 2**20
MAX_IMAGE_PIXELS = 40_000_000


def decode_image(cell: Any, base_dir: Optional[Path] = None):
    """An RGB `PIL.Image` from one cell (`{"bytes", "path"}`, bytes, or a path); `BadImage` otherwise,
    also for more than `MAX_IMAGE_BYTES` encoded or `MAX_IMAGE_PIXELS` declared."""
    from PIL import Image, UnidentifiedImageError

    if hasattr(cell, "convert") and hasattr(cell, "size"):   # already an image (generators)
        return cell.convert("RGB")
    data, path = (cell.get("bytes"), cell.get("path")) if isinstance(cell, dict) else (
        (cell, None) if isinstance(cell, (bytes, bytearray)) else (None, cell))
    if data is None and not path:
        raise BadImage("an image cell has neither bytes nor a path")
    if data is None:
        p = Path(str(path))
        if not p.is_absolute() and base_dir is not None:
            p = base_dir / p
        if not p.is_file():
            raise BadImage(f"image file {str(path)!r} not found")
        with open(p, "rb") as f:
            data = f.read(MAX_IMAGE_BYTES + 1)
    if len(data) > MAX_IMAGE_BYTES:
        raise BadImage(f"image of more than {MAX_IMAGE_BYTES // 2**20} MiB")
    try:
        with Image.open(io.BytesIO(bytes(data))) as im:
            if im.size[0] * im.size[1] > MAX_IMAGE_PIXELS:
                raise BadImage(f"image of {im.size[0]}x{im.size[1]} pixels, more than {MAX_IMAGE_PIXELS:,}")
            return im.convert("RGB")
    except BadImage:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise BadImage(f"image bytes cannot be decoded ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def with_placeholders(prompt: Any) -> Any:
    """`prompt` with chat image parts as `<image>` text: a message whose content is a list of
    parts (`{"type": "text", "text": ...}`, `{"type": "image"}`) becomes one string."""
    if isinstance(prompt, str):
        return prompt
    out = []
    for m in prompt:
        content = m.get("content")
        if isinstance(content, (list, tuple)):
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in ("image", "image_url"):
                    parts.append(PLACEHOLDER)
                elif kind == "text":
                    parts.append(str(part.get("text", "")))
                else:
                    raise BadImage(f"a content part of type {kind!r} (text and image parts are read)")
            m = {**m, "content": "".join(parts)}
        out.append(m)
    return out


def placeholder_count(prompt: Any) -> int:
    if isinstance(prompt, str):
        return prompt.count(PLACEHOLDER)
    return sum(str(m.get("content", "")).count(PLACEHOLDER) for m in prompt)


class ImageProcessor:
    """A model's image processor plus its placeholder tokens: images -> `ImageInputs`, marks -> tokens."""

    def __init__(self, processor: Any, tokens: VisionTokens = VisionTokens(), positions: Any = None,
                 tokens_per_image: Optional[int] = None):
        """`positions(ids [1, S], image_grid_thw) -> [3, 1, S]`: the model's mRoPE ids of a prompt
        (`mrl.models.vlm.mrope_position_ids`), kept with its images for the trainer.
        `tokens_per_image`: a model whose every image is that many tokens and which takes no
        grid (Gemma 3's `mm_tokens_per_image`: its processor resizes every image to one size)."""
        self.processor = processor
        self.tokens = tokens
        self.positions = positions
        self.tokens_per_image = tokens_per_image

    def with_positions(self, images: ImageInputs, token_ids: list[int]) -> ImageInputs:
        """`images` with the prompt's mRoPE ids (when this processor knows the model's)."""
        if self.positions is None:
            return images
        import dataclasses

        import torch

        pos = self.positions(torch.tensor([token_ids]), images.image_grid_thw)[:, 0]
        return dataclasses.replace(images, prompt_positions=pos)

    def process(self, cells: list, prompt: Any, base_dir: Optional[Path] = None) -> ImageInputs:
        """The processor's outputs for a row's image cells; `BadImage` when a cell cannot be
        decoded or the prompt's marks do not pair up with the images."""
        marks = placeholder_count(prompt)
        if marks != len(cells):
            raise BadImage(f"{marks} {PLACEHOLDER} mark(s) for {len(cells)} image(s)")
        images = [self.resized(decode_image(c, base_dir)) for c in cells]
        out = self.processor(images=images, return_tensors="pt")
        if self.tokens_per_image is not None:   # one size for every image, no grid (Gemma 3)
            return ImageInputs(pixel_values=out["pixel_values"], image_grid_thw=None,
                               tokens_per_image=(self.tokens_per_image,) * len(images), images=tuple(images))
        grid = out["image_grid_thw"]
        per = tuple(int(n) for n in (grid.prod(-1) // self.tokens.merge_size ** 2).tolist())
        return ImageInputs(pixel_values=out["pixel_values"], image_grid_thw=grid, tokens_per_image=per,
                           images=tuple(images))

    def resized(self, image):
        """`image` at the size the processor resizes it to (Qwen-VL's `smart_resize`: sides that are
        multiples of patch x merge, the pixel count within the processor's budget), with the
        processor's own resampling. The processor's resize of the result is the identity, so the
        kept image is exactly what the processor turned into `pixel_values` (and what a rollout
        engine with its own processor, vLLM, gets)."""
        from PIL import Image
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        p = self.processor
        size = dict(getattr(p, "size", None) or {})
        if not getattr(p, "do_resize", True) or "shortest_edge" not in size or "longest_edge" not in size:
            return image
        try:
            h, w = smart_resize(image.height, image.width, factor=int(p.patch_size) * int(p.merge_size),
                                min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
        except ValueError as e:   # an aspect ratio over 200
            raise BadImage(str(e)) from None
        if (w, h) == image.size:
            return image
        return image.resize((w, h), resample=Image.Resampling(int(getattr(p, "resample", Image.Resampling.BICUBIC))))

    def expand(self, text: str, images: ImageInputs) -> str:
        """`text` with its k-th `<image>` mark as image k's vision tokens (start, pads, end)."""
        if text.count(PLACEHOLDER) != len(images.tokens_per_image):
            from mrl.errors import UserError

            raise UserError(f"the rendered prompt holds {text.count(PLACEHOLDER)} {PLACEHOLDER} marks for "
                            f"{len(images.tokens_per_image)} image(s) (a system prompt or chat template with {PLACEHOLDER}?)")
        counts = iter(images.tokens_per_image)
        t = self.tokens
        return re.sub(re.escape(PLACEHOLDER), lambda _: t.start + t.pad * next(counts) + t.end, text)


def model_image_processor(model_path: str, hf: dict[str, Any]) -> "ImageProcessor | None":
    """The job's `mrl.data.images.ImageProcessor` for a VLM (None for a text model): the
    checkpoint's own image processor (`preprocessor_config.json`), or the tiny preset's."""
    from mrl.errors import UserError
    from mrl.models.vlm import is_vlm, mrope_position_ids, tiny_image_processor

    if not is_vlm(hf):
        return None
    if hf["model_type"] == "gemma3":
        return _gemma3_processor(model_path, hf)
    merge = int(hf["vision_config"].get("spatial_merge_size", 2))

    def positions(ids, grid):
        return mrope_position_ids(hf, ids, grid)

    if model_path.startswith("builtin:"):   # a preset (`mrl.models.facts`) has no files
        return ImageProcessor(tiny_image_processor(hf), VisionTokens(merge_size=merge), positions)
    from transformers import AutoImageProcessor

    try:
        proc = AutoImageProcessor.from_pretrained(model_path)
    except (OSError, ValueError) as e:
        raise UserError(f"model.path: no image processor in {model_path!r} ({str(e).splitlines()[0]}); a "
                        "vision-language checkpoint needs its preprocessor_config.json") from None
    return ImageProcessor(proc, VisionTokens(merge_size=merge), positions)


#: Gemma 3's image tokens as its processor writes them (`Gemma3Processor.full_image_sequence`)
GEMMA3_TOKENS = VisionTokens(start="\n\n<start_of_image>", pad="<image_soft_token>", end="<end_of_image>\n\n",
                             merge_size=1)


def _gemma3_processor(model_path: str, hf: dict[str, Any]) -> ImageProcessor:
    """The multimodal Gemma 3's: every image `mm_tokens_per_image` tokens, plain positions; a
    preset's byte tokenizer has the Qwen-VL specials as its image start / token / end (ids 259-261)."""
    from mrl.errors import UserError
    from mrl.models.vlm import pan_and_scan_problem, tiny_image_processor

    per = int(hf["mm_tokens_per_image"])
    if model_path.startswith("builtin:"):
        return ImageProcessor(tiny_image_processor(hf), VisionTokens(merge_size=1), tokens_per_image=per)
    from transformers import AutoImageProcessor

    try:
        proc = AutoImageProcessor.from_pretrained(model_path)
    except (OSError, ValueError) as e:
        raise UserError(f"model.path: no image processor in {model_path!r} ({str(e).splitlines()[0]}); a "
                        "vision-language checkpoint needs its preprocessor_config.json") from None
    if getattr(proc, "do_pan_and_scan", False):   # `mrl validate` refused it already (`vlm.pan_and_scan_problem`)
        raise UserError(pan_and_scan_problem(model_path) or f"model.path: {model_path!r}'s image processor has "
                        "do_pan_and_scan (crops as extra images) which mrl does not run")
    return ImageProcessor(proc, GEMMA3_TOKENS, tokens_per_image=per)
