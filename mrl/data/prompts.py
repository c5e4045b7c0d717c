"""Rendered, tokenized prompts ready for rollout, with over-long prompts handled as the job says.

`data.prompt_overflow`: "drop" (counted in `prompts_overlong_dropped`), "truncate_left" (keep the
last `data.max_prompt_tokens` tokens, counted in `prompts_truncated`; the end of a chat prompt
holds the question and the generation prompt), or "error" (a `UserError` naming the row).

A prompt whose text alone is over `prompt_byte_limit` bytes cannot fit the model whatever its
tokens, and tokenizing it costs memory in proportion (a 200 MB cell would take gigabytes): it is
never tokenized. "error" refuses it naming the row; "drop" and "truncate_left" drop it, counted in
`prompts_oversized_dropped` (truncating would need its tokens).
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from mrl.data.images import IMAGE_COLUMN, BadImage, ImageInputs, ImageProcessor, image_cells, with_placeholders
from mrl.data.rows import Prompt, PromptRow
from mrl.data.template import encode_prompt, render_prompt
from mrl.errors import UserError

log = logging.getLogger(__name__)

Overflow = Literal["error", "drop", "truncate_left"]


@dataclass(frozen=True)
class PromptItem:
    """One prompt of a dataset: what the rollout engine gets (`token_ids`) and what the reward needs."""

    index: int  # position in the dataset (what the sampler yields)
    token_ids: tuple[int, ...]
    text: str  # rendered text (before any truncation)
    prompt: Prompt  # the raw cell, as the reward function receives it
    answer: Any
    data_source: str
    origin: str
    extra: dict = field(default_factory=dict)
    images: Optional[ImageInputs] = None  # the processor's outputs for the prompt's images (VLMs)


@dataclass
class PromptDataset:
    """Prompts in a fixed order plus the counts of everything dropped or changed on the way."""

    items: list[PromptItem]
    stats: dict[str, int]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]


BYTES_PER_TOKEN = 32   # a generous bound on the bytes of one token: a longer prompt cannot fit the model


def prompt_bytes(prompt: Any) -> int:
    """The UTF-8 bytes of a prompt's text (a chat prompt: its messages' contents)."""
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8", "surrogatepass"))
    return sum(prompt_bytes(str(m.get("content", ""))) for m in prompt)


def prompt_byte_limit(max_prompt_tokens: int, tokenizer: Any) -> int:
    """The bytes a prompt may have before tokenizing: the longer of the tokenizer's
    `model_max_length` (when it states one) and `data.max_prompt_tokens`, x `BYTES_PER_TOKEN`. A
    prompt beyond it cannot fit the model whatever its tokens, and tokenizing it costs memory."""
    stated = getattr(tokenizer, "model_max_length", None)
    tokens = max(max_prompt_tokens, stated if isinstance(stated, int) and stated < 10**7 else 0)
    return tokens * BYTES_PER_TOKEN


def fit_length(ids: list[int], max_tokens: int, overflow: Overflow, origin: str) -> list[int] | None:
    """`ids` if short enough, else truncated from the left, None (drop) or a UserError."""
    if len(ids) <= max_tokens:
        return ids
    if overflow == "error":
        raise UserError(f"{origin}: prompt has {len(ids)} tokens > data.max_prompt_tokens {max_tokens} "
                        "(set data.prompt_overflow = 'drop' or 'truncate_left')")
    return ids[-max_tokens:] if overflow == "truncate_left" else None


def tokenize_rows(rows: list[PromptRow], tokenizer: Any, *, max_prompt_tokens: int, overflow: Overflow,
                  chat_template: bool, system_prompt: str | None = None,
                  stats: Counter | None = None, special_tokens_in_text: str = "escape",
                  tools: list[dict] | None = None, images: ImageProcessor | None = None,
                  bad_rows: Literal["warn", "error"] = "warn") -> PromptDataset:
    """Render and tokenize `rows`; `stats` (rows counters from loading) gains the prompt counters.
    `tools`: function schemas the chat template lists (multi-turn jobs).
    Special-token text in a row follows `special_tokens_in_text` (`mrl.data.special`).
    `images` (a vision-language model's processor): a row's `images` cells are processed and its
    `<image>` marks expanded (`mrl.data.images`); a row whose images cannot be used is dropped and
    counted (`prompts_bad_image_dropped`) or, with `bad_rows = "error"`, stops the run in one line.
    A prompt with images is never truncated (its image tokens would no longer match): over
    `max_prompt_tokens` it is dropped (or refused)."""
    from mrl.data import special

    counts = Counter(stats or {})
    counts.update({"prompts_overlong_dropped": 0, "prompts_truncated": 0})
    byte_limit = prompt_byte_limit(max_prompt_tokens, tokenizer)
    specials = special.special_strings(tokenizer)
    in_tools = special.special_in_tools(tools, specials) if tools and specials and chat_template else []
    if in_tools:
        if special_tokens_in_text == "error":
            raise special.refuse_tools(tools, specials)
        held = sum(bool(special.special_in_tools([t], specials)) for t in tools)
        counts["tools_special_text_escaped" if special_tokens_in_text == "escape" else "tools_special_text_allowed"] = held
    items: list[PromptItem] = []
    if images is not None:
        counts["prompts_bad_image_dropped"] += 0
    for row in rows:
        vision: ImageInputs | None = None
        prompt = row.prompt
        extra = row.extra
        if images is not None and (IMAGE_COLUMN in row.extra or "<image>" in str(row.prompt)):
            try:
                prompt = with_placeholders(row.prompt)
                vision = images.process(image_cells(row.extra.get(IMAGE_COLUMN)), prompt)
            except BadImage as e:
                if bad_rows == "error":
                    raise UserError(f"{row.origin}: {e} (set data.bad_rows = 'warn' to drop and count such rows)") from None
                log.warning("%s: %s; row dropped", row.origin, e)
                counts["prompts_bad_image_dropped"] += 1
                continue
            extra = {k: v for k, v in row.extra.items() if k != IMAGE_COLUMN}
        expand = (lambda t: images.expand(t, vision)) if vision is not None else (lambda t: t)
        size = prompt_bytes(prompt)
        if size > byte_limit:   # never tokenized: it cannot fit, and tokenizing it costs memory
            if overflow == "error":
                raise UserError(f"{row.origin}: prompt has {size} bytes, more than {byte_limit} = "
                                f"{byte_limit // BYTES_PER_TOKEN} tokens x {BYTES_PER_TOKEN} bytes; it is not "
                                "tokenized (set data.prompt_overflow = 'drop' to skip such rows)")
            counts["prompts_oversized_dropped"] += 1
            continue
        found = special.special_in(prompt, specials) if specials else []
        if found and special_tokens_in_text == "error":
            raise special.refuse(row.origin, found)
        if (found or in_tools) and special_tokens_in_text == "escape":
            if found:
                counts["prompts_special_text_escaped"] += 1
            pieces: list[str] = []
            row_tools = special.mark_tools(tools, specials, pieces) if in_tools else tools
            marked, pieces = special.mark(prompt, specials, pieces) if found else (prompt, pieces)
            rendered = expand(render_prompt(marked, tokenizer, chat_template=chat_template,
                                            system_prompt=system_prompt, origin=row.origin, tools=row_tools))
            text = special.unmark(rendered, pieces)
            ids = special.encode_escaped(rendered, pieces, tokenizer, add_special_tokens=not chat_template)
        else:
            if found:
                counts["prompts_special_text_allowed"] += 1
            text = expand(render_prompt(prompt, tokenizer, chat_template=chat_template, system_prompt=system_prompt,
                                        origin=row.origin, tools=tools))
            ids = encode_prompt(text, tokenizer, chat_template=chat_template)
        fitted = fit_length(ids, max_prompt_tokens, "drop" if vision is not None and overflow != "error" else overflow,
                            row.origin)
        if fitted is None:
            counts["prompts_overlong_dropped"] += 1
            continue
        if len(fitted) < len(ids):
            counts["prompts_truncated"] += 1
        items.append(PromptItem(index=len(items), token_ids=tuple(fitted), text=text, prompt=row.prompt,
                                answer=row.answer, data_source=row.data_source, origin=row.origin, extra=extra,
                                images=images.with_positions(vision, fitted) if vision is not None else None))
    counts["prompts"] = len(items)
    return PromptDataset(items=items, stats=dict(counts))
