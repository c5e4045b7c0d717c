"""SFT examples: rows -> token ids with a loss mask on the assistant tokens only.

Two row formats (`sft.format`):

- `prompt_response`: `data.prompt_key` (text or chat messages) and `sft.response_key` (text). With
  `data.chat_template` the response is one assistant message after the prompt's messages; without
  it the example is `prompt tokens + response tokens + EOS`, the loss on the response and EOS.
- `messages`: `sft.messages_key` holds a whole conversation. Every assistant turn is trained on
  (its content and the template's end-of-turn tokens); system, user and tool turns, and the
  template's "assistant" headers, are context only.

Masking uses the template itself: rendering the first k messages must be a prefix of rendering
k + 1 (true of ChatML, Llama-3, Qwen2.5 and most templates), so each assistant turn is exactly the
text its message adds after the generation prompt. A template that rewrites earlier turns (e.g.
one that strips past reasoning) breaks that; such a row is an error naming it, never a silently
wrong mask.

An example becomes one `Batch` row: the tokens before the first trained token are the "prompt",
the rest the "response" with `response_mask` = 1 on trained tokens, so the RL engine's packing,
loss counting and log-prob kernels apply unchanged. Trailing untrained tokens are dropped (they
cannot change the loss of a causal model).

Images (a vision-language model; verl's multimodal layout, `mrl.data.images`): a row's `images`
cells go through the model's image processor once, and its `<image>` marks (in the text or as chat
image parts, in any non-assistant turn) become the vision tokens in order, as for RL prompts. The
example keeps its `ImageInputs` with the mRoPE ids of the whole sequence (its images may come after
its first trained token), which the packing takes whole. Vision tokens are never trained: a row
whose trained text would hold one (an image in an assistant turn) is a bad image row, like
undecodable bytes, a missing file or marks that do not pair up with the images: one line, dropped
and counted in `rows_bad_image_dropped` (or an error with `data.bad_rows = "error"`). An example
with images is never cut: over `sft.max_tokens` it is dropped (or refused with `truncation = "error"`).
"""
from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Any, Callable, Literal

from mrl.errors import UserError


@dataclasses.dataclass(frozen=True)
class Example:
    """One tokenized example: `prompt_ids + response_ids`, `loss_mask` per response token."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    origin: str
    images: Any = None   # `mrl.data.images.ImageInputs` (mRoPE ids of the whole sequence) or None

    @property
    def tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def loss_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclasses.dataclass
class ExampleSet:
    examples: list[Example]
    stats: dict[str, int]

    def __len__(self) -> int:
        return len(self.examples)


def segments_of(messages: list[dict], tokenizer: Any, origin: str) -> list[tuple[str, bool]]:
    """`(text, trained)` pieces whose concatenation is the rendered conversation; `trained` for
    the text each assistant message adds after its generation prompt."""
    def render(msgs, gen):
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)

    out: list[tuple[str, bool]] = []
    done = ""
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before = render(messages[:i], True) if i else ""
        after = render(messages[:i + 1], False)
        if not before.startswith(done) or not after.startswith(before):
            raise UserError(f"{origin}: the chat template does not render this conversation incrementally "
                            f"(turn {i} rewrites earlier text), so assistant tokens cannot be masked exactly")
        out.append((before[len(done):], False))
        out.append((after[len(before):], True))
        done = after
    full = render(messages, False)
    if not full.startswith(done):
        raise UserError(f"{origin}: the chat template renders the whole conversation differently from its turns")
    out.append((full[len(done):], False))
    return [(t, trained) for t, trained in out if t]


def tokenize_segments(segments: list[tuple[str, bool]], tokenizer: Any,
                      expand: Callable[[str], str] = lambda t: t) -> tuple[list[int], list[int]]:
    """Token ids and 0/1 loss flags; each piece is tokenized on its own (templates put special
    tokens at the boundaries, so this equals tokenizing the whole text there). `expand` turns a
    piece's `<image>` marks into vision tokens (in order over the pieces)."""
    ids: list[int] = []
    flags: list[int] = []
    for text, trained in segments:
        piece = tokenizer(expand(text), add_special_tokens=False)["input_ids"]
        ids += piece
        flags += [int(trained)] * len(piece)
    return ids, flags


def _split(ids: list[int], flags: list[int], origin: str) -> Example | None:
    """Prompt = tokens before the first trained one (at least one token: the first token of a
    sequence is never predicted); trailing untrained tokens dropped."""
    if 1 not in flags[1:]:
        return None   # the very first token has no context to be predicted from
    first = max(flags.index(1), 1)
    last = len(flags) - flags[::-1].index(1)
    return Example(prompt_ids=ids[:first], response_ids=ids[first:last], loss_mask=flags[first:last], origin=origin)


def example_from_row(prompt: Any, response: Any, tokenizer: Any, *, fmt: Literal["prompt_response", "messages"],
                     chat_template: bool, system_prompt: str | None, origin: str,
                     expand: Callable[[str], str] = lambda t: t) -> Example | None:
    """The tokenized example of one row (None: nothing to train on); `expand`: see `tokenize_segments`."""
    from mrl.data.template import to_messages

    if fmt == "messages":
        return _split(*tokenize_segments(segments_of(to_messages(prompt, system_prompt), tokenizer, origin),
                                         tokenizer, expand), origin)
    if chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"the tokenizer has no chat template; set data.chat_template = false ({origin})")
        messages = to_messages(prompt, system_prompt) + [{"role": "assistant", "content": response}]
        return _split(*tokenize_segments(segments_of(messages, tokenizer, origin), tokenizer, expand), origin)
    if not isinstance(prompt, str):
        raise UserError(f"{origin}: a chat-message prompt needs data.chat_template = true")
    text = expand(f"{system_prompt}\n\n{prompt}" if system_prompt else prompt)
    prompt_ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    response_ids = list(tokenizer(response, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is not None:
        response_ids.append(tokenizer.eos_token_id)
    return Example(prompt_ids, response_ids, [1] * len(response_ids), origin) if response_ids else None


def _fit(ex: Example, max_tokens: int, truncation: str) -> Example | None | str:
    if ex.tokens <= max_tokens:
        return ex
    if truncation == "error":
        raise UserError(f"{ex.origin}: {ex.tokens} tokens, more than sft.max_tokens {max_tokens} "
                        "(set sft.truncation = 'drop' or 'right')")
    if truncation == "drop" or len(ex.prompt_ids) >= max_tokens or ex.images is not None:   # images: never cut
        return "dropped"
    keep = max_tokens - len(ex.prompt_ids)
    mask = ex.loss_mask[:keep]
    if 1 not in mask:
        return "dropped"
    return Example(ex.prompt_ids, ex.response_ids[:keep], mask, ex.origin)


def _image_example(row: Any, prompt: Any, response: Any, tokenizer: Any, images: Any, spec) -> Example | None:
    """`example_from_row` for a row with images: processed once, marks expanded in order, the whole
    sequence's mRoPE ids kept; `BadImage` when the images cannot be used or a trained token would be
    a vision token."""
    from mrl.data.images import IMAGE_COLUMN, PLACEHOLDER, BadImage, image_cells, with_placeholders

    data = spec.data
    prompt = with_placeholders(prompt)
    vision = images.process(image_cells(row.extra.get(IMAGE_COLUMN)), prompt)
    counts = iter(vision.tokens_per_image)
    t = images.tokens

    def expand(text: str) -> str:
        try:
            return re.sub(re.escape(PLACEHOLDER), lambda _: t.start + t.pad * next(counts) + t.end, text)
        except StopIteration:
            raise BadImage(f"the rendered example holds more {PLACEHOLDER} marks than the row's "
                           f"{len(vision.tokens_per_image)} image(s) (a system prompt with {PLACEHOLDER}?)") from None

    ex = example_from_row(prompt, response, tokenizer, fmt=spec.sft.format, chat_template=data.chat_template,
                          system_prompt=data.system_prompt, origin=row.origin, expand=expand)
    if ex is None:
        return None
    vision_ids = {tokenizer.convert_tokens_to_ids(x) for x in (t.start, t.pad, t.end)}
    ids = ex.prompt_ids + ex.response_ids
    pads = ids.count(tokenizer.convert_tokens_to_ids(t.pad))
    if pads != sum(vision.tokens_per_image):
        raise BadImage(f"{pads} image tokens for {sum(vision.tokens_per_image)} image features (an image after "
                       "the last trained token, or image tokens written in the text?)")
    if any(m and i in vision_ids for i, m in zip(ex.response_ids, ex.loss_mask)):
        raise BadImage("an image in a trained (assistant) turn: vision tokens are never trained")
    return dataclasses.replace(ex, images=images.with_positions(vision, ids))


def load_examples(spec, tokenizer: Any, split: Literal["train", "val"] = "train", images: Any = None) -> ExampleSet:
    """The tokenized SFT examples of `split` (data files or generator), with counts of what was
    read, dropped and truncated. `images`: a vision-language model's `mrl.data.images.ImageProcessor`
    (None for a text model)."""
    from mrl.data.images import IMAGE_COLUMN, PLACEHOLDER, BadImage
    from mrl.data.rows import lookup
    from mrl.data.source import load_rows

    data, sft = spec.data, spec.sft
    key = sft.messages_key if sft.format == "messages" else data.prompt_key
    cfg = dataclasses.replace(data, prompt_key=key)
    stats: Counter = Counter({"rows_read": 0, "rows_bad_prompt": 0})
    rows = load_rows(cfg, split, require_answer=False, stats=stats)
    if split == "val" and sft.val_examples is not None:
        rows = rows[:sft.val_examples]
    examples: list[Example] = []
    for row in rows:
        response = None
        if sft.format == "prompt_response":
            response = lookup(row.extra, sft.response_key)
            if not isinstance(response, str) or not response.strip():
                problem = f"response column {sft.response_key!r} (sft.response_key) is missing or empty"
                if data.bad_rows == "error":
                    raise UserError(f"{row.origin}: {problem} (set data.bad_rows = 'warn' to drop and count such rows)")
                stats["rows_bad_response"] += 1
                continue
        if images is not None and (IMAGE_COLUMN in row.extra or PLACEHOLDER in str(row.prompt)):
            stats["rows_bad_image_dropped"] += 0
            try:
                ex = _image_example(row, row.prompt, response, tokenizer, images, spec)
            except BadImage as e:
                if data.bad_rows == "error":
                    raise UserError(f"{row.origin}: {e} (set data.bad_rows = 'warn' to drop and count such rows)") from None
                import logging

                logging.getLogger(__name__).warning("%s: %s; row dropped", row.origin, e)
                stats["rows_bad_image_dropped"] += 1
                continue
        else:
            ex = example_from_row(row.prompt, response, tokenizer, fmt=sft.format, chat_template=data.chat_template,
                                  system_prompt=data.system_prompt, origin=row.origin)
        if ex is None:
            if data.bad_rows == "error":
                raise UserError(f"{row.origin}: no assistant tokens to train on")
            stats["rows_no_assistant"] += 1
            continue
        fitted = _fit(ex, sft.max_tokens, sft.truncation)
        if fitted == "dropped":
            stats["examples_too_long_dropped"] += 1
            continue
        if fitted is not ex:
            stats["examples_truncated"] += 1
        examples.append(fitted)
    stats["examples"] = len(examples)
    if not examples:
        raise UserError(f"no {split} examples left after filtering: {dict(stats)}")
    return ExampleSet(examples, dict(stats))


def to_batch(examples: list[Example], pad_id: int = 0):
    """A `Batch` of examples (one group each), the response mask on trained tokens; examples with
    images carry them as the RL trainer's prompt items do (`prompt_item[i].images`)."""
    from types import SimpleNamespace

    from mrl.batch import Batch

    batch = Batch.from_sequences([e.prompt_ids for e in examples], [e.response_ids for e in examples],
                                 loss_masks=[e.loss_mask for e in examples], pad_id=pad_id)
    if any(e.images is not None for e in examples):
        batch = Batch(batch.tensors, {**batch.meta, "prompt_item": [SimpleNamespace(images=e.images) for e in examples]})
    return batch
