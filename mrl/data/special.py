"""Special-token text inside prompts, and inside the tool schemas the chat template lists:
`data.special_tokens_in_text`.

A tokenizer turns the text `<|im_end|>` into the special token itself, so a prompt (or a message
of one) that merely contains that text ends a turn, or the document, where the user wrote
characters. The job chooses what such text becomes:

- "escape" (default): it is tokenized as the plain characters it is (the template's own special
  tokens are still special); each prompt so escaped is counted (`prompts_special_text_escaped`);
- "error": the first such prompt stops the run in one line naming it (`mrl validate` cannot see
  the rows, so this is a load-time check, before any compute);
- "allow": the old behaviour, the text becomes the special token, counted
  (`prompts_special_text_allowed`).

Tool schemas (a tool server names and describes its tools; the template writes them into every
prompt) get the same treatment: escaped (`tools_special_text_escaped`: the tools listed that
hold such text), refused in one line naming the tool, or allowed (`tools_special_text_allowed`).
"""
from __future__ import annotations

import re
from typing import Any, Literal

from mrl.errors import UserError

Mode = Literal["error", "escape", "allow"]
_MARK = "\ue000{}\ue001"              # private-use characters: never in a tokenizer's special tokens
_MARK_RE = re.compile("\ue000(\\d+)\ue001")


def special_strings(tokenizer: Any) -> list[str]:
    """The tokenizer's special tokens as text, longest first (so `<|im_end|>` wins over a prefix)."""
    found = set(getattr(tokenizer, "all_special_tokens", None) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            found.add(str(tok.content))
    return sorted((s for s in found if s), key=len, reverse=True)


def _contents(prompt) -> list[str]:
    return [prompt] if isinstance(prompt, str) else [str(m.get("content", "")) for m in prompt]


def special_in(prompt, specials: list[str]) -> list[str]:
    """The special-token strings the prompt's text holds."""
    return [s for s in specials if any(s in c for c in _contents(prompt))]


def _strings(value) -> list[str]:
    """Every string in a JSON-like value (keys too), as tool schemas hold them."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [t for k, v in value.items() for t in (*_strings(k), *_strings(v))]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _strings(v)]
    return []


def special_in_tools(tools, specials: list[str]) -> list[str]:
    """The special-token strings the tool schemas (names, descriptions, parameters) hold."""
    texts = _strings(tools or [])
    return [s for s in specials if any(s in t for t in texts)]


def mark_tools(tools, specials: list[str], pieces: list[str]):
    """The tool schemas with every special-token string in them (keys and values) replaced by a
    numbered marker, appended to `pieces`: the chat template lists them as plain characters."""
    pattern = re.compile("|".join(re.escape(s) for s in specials))

    def sub(m):
        pieces.append(m.group(0))
        return _MARK.format(len(pieces) - 1)

    def walk(value):
        if isinstance(value, str):
            return pattern.sub(sub, value)
        if isinstance(value, dict):
            return {walk(k): walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v) for v in value]
        return value

    return walk(tools)


def mark(prompt, specials: list[str], pieces: list[str] | None = None) -> tuple[Any, list[str]]:
    """`prompt` with every special-token string replaced by a numbered marker, and the strings
    (appended to `pieces` when given: markers of the tool schemas come first)."""
    pattern = re.compile("|".join(re.escape(s) for s in specials))
    pieces = [] if pieces is None else pieces

    def sub(m):
        pieces.append(m.group(0))
        return _MARK.format(len(pieces) - 1)

    if isinstance(prompt, str):
        return pattern.sub(sub, prompt), pieces
    return [{**m, "content": pattern.sub(sub, str(m.get("content", "")))} for m in prompt], pieces


def unmark(text: str, pieces: list[str]) -> str:
    return _MARK_RE.sub(lambda m: pieces[int(m.group(1))], text)


def encode_escaped(text: str, pieces: list[str], tokenizer: Any, *, add_special_tokens: bool) -> list[int]:
    """Token ids of marked `text`: the segments between markers as usual, each marked piece as
    plain characters; with `add_special_tokens` the tokenizer's BOS/EOS framing around all."""
    ids: list[int] = []
    pos = 0
    for m in _MARK_RE.finditer(text):
        if m.start() > pos:
            ids += tokenizer(text[pos:m.start()], add_special_tokens=False)["input_ids"]
        ids += tokenizer(pieces[int(m.group(1))], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        pos = m.end()
    if pos < len(text):
        ids += tokenizer(text[pos:], add_special_tokens=False)["input_ids"]
    if add_special_tokens:
        frame = list(tokenizer("", add_special_tokens=True)["input_ids"])
        bos, eos = getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)
        head = frame[:1] if frame and bos is not None and frame[0] == bos else []
        tail = frame[-1:] if len(frame) > len(head) and eos is not None and frame[-1] == eos else []
        ids = head + ids + tail
    return list(ids)


def refuse_tools(tools, specials: list[str]) -> UserError:
    for tool in tools:
        found = special_in_tools([tool], specials)
        if found:
            name = (tool.get("function") or {}).get("name", "?") if isinstance(tool, dict) else "?"
            return UserError(f"rollout.multi_turn: the schema of tool {str(name)[:80]!r} holds the special token text "
                             f"{found[0]!r} (data.special_tokens_in_text = 'error'; 'escape' lists it as plain text)")
    return UserError("rollout.multi_turn: a tool schema holds special token text")


def refuse(origin: str, found: list[str]) -> UserError:
    return UserError(f"{origin}: the prompt holds the special token text {found[0]!r} (data.special_tokens_in_text = "
                     "'error'; 'escape' tokenizes it as plain text, 'allow' as the special token)")
