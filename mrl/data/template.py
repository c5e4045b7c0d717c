"""Prompt text as the model sees it: the tokenizer's chat template, or the raw string.

With `data.chat_template = true` a string prompt becomes one user message, `data.system_prompt`
is prepended as a system message (unless the messages already start with one), and the
tokenizer's own template renders them with the generation prompt appended. With it off, a string
prompt is used as is (the system prompt, if any, precedes it on its own paragraph); chat messages
need a template.
"""
from __future__ import annotations

from typing import Any

from mrl.data.rows import Prompt
from mrl.errors import UserError


def to_messages(prompt: Prompt, system_prompt: str | None) -> list[dict]:
    """Chat messages for `prompt`, with the system prompt first when one is set and none is present."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system_prompt and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def render_prompt(prompt: Prompt, tokenizer: Any, *, chat_template: bool, system_prompt: str | None = None,
                  origin: str = "prompt", tools: list[dict] | None = None) -> str:
    """The text to tokenize for `prompt` (see the module docstring for the rules); `tools`
    (function schemas of a multi-turn job) go to the template, which lists them for the model."""
    if chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"the tokenizer has no chat template; set data.chat_template = false ({origin})")
        return tokenizer.apply_chat_template(to_messages(prompt, system_prompt), add_generation_prompt=True,
                                             tokenize=False, **({"tools": tools} if tools else {}))
    if not isinstance(prompt, str):
        raise UserError(f"{origin}: a chat-message prompt needs data.chat_template = true")
    return f"{system_prompt}\n\n{prompt}" if system_prompt else prompt


def encode_prompt(text: str, tokenizer: Any, *, chat_template: bool) -> list[int]:
    """Token ids of rendered prompt text. A chat template already wrote its special tokens, so
    none are added then; a raw prompt gets the tokenizer's usual ones (e.g. BOS)."""
    return list(tokenizer(text, add_special_tokens=not chat_template)["input_ids"])
