"""Tool-call formats: how a model writes its calls, and how to recognise its chat template.

`rollout.multi_turn.format` picks one parser; each reads the decoded text of one assistant turn
and returns its calls in order. The syntax each accepts is that of vLLM's parser of the same
name, with one difference in kind: a malformed call becomes an error string that the model then
sees as the call's tool message (vLLM answers the whole turn as plain text), so the model learns
what went wrong:

- hermes (Qwen2.5/Qwen3, NousHermes, the builtin presets): `<tool_call>{"name", "arguments"}</tool_call>`
  blocks anywhere in the turn; a last block left open at the end of the turn (a stop string cut
  it) counts when its JSON is complete;
- llama3_json (Llama 3.1-3.3): the turn is the call, a JSON object `{"name", "parameters"}` (or
  "arguments"), optionally after `<|python_tag|>`, several separated by `;`; a turn that does not
  start with `{` is a plain answer (vLLM also looks for calls after leading text);
- mistral (Mistral v0.3 and later): after `[TOOL_CALLS]`, a JSON list of `{"name", "arguments", "id"}`
  (v0.3) or `name[ARGS]{json}` items (v11 tokenizers).

`auto` picks the format whose tool-call markers the chat template writes (`detect_format`);
`template_problem` is the one-line refusal when a template cannot carry the chosen format.
No parser from vLLM or transformers is used: vLLM's need its own tokenizer and request objects
(and vLLM, absent on CPU), and transformers' `parse_response` reads a per-model response schema
that few tokenizers ship.
"""
from __future__ import annotations

import json
from typing import Optional, Union

from mrl.rollout.tools import ToolCall

Parsed = Union[ToolCall, str]   # a call, or the error text the model sees for a malformed one


def _call(obj, args_keys: tuple[str, ...]) -> ToolCall:
    """A ToolCall from a decoded JSON object; ValueError names what is missing."""
    if not isinstance(obj, dict):
        raise ValueError("a call is a JSON object")
    args = next((obj[k] for k in args_keys if k in obj), {})
    args = json.loads(args) if isinstance(args, str) else args
    if not isinstance(obj.get("name"), str) or not isinstance(args, dict):
        raise ValueError(f"needs a string 'name' and an object '{args_keys[0]}'")
    return ToolCall(obj["name"], args)


def _malformed(e: Exception) -> str:
    return f"error: malformed tool call ({e})"


class ToolFormat:
    """A tool-call syntax: `parse` one assistant turn's text; `markers`: what a chat template that
    renders this format's calls contains (any of them)."""

    name = ""
    markers: tuple[str, ...] = ()
    end_tokens: tuple[str, ...] = ()   # end-of-turn text the decoded turn may end with

    def parse_with_ids(self, text: str) -> list[tuple[Parsed, Optional[str]]]:
        """(call or error text, the call id the model wrote or None), in order."""
        raise NotImplementedError

    def parse(self, text: str) -> list[Parsed]:
        """The tool calls in `text`; a malformed call becomes an error string for the model."""
        return [c for c, _ in self.parse_with_ids(text)]

    def _strip_end(self, text: str) -> str:
        text = text.strip()
        for end in self.end_tokens:
            if text.endswith(end):
                return text[:-len(end)].rstrip()
        return text


class HermesFormat(ToolFormat):
    """Hermes tool calls (Qwen2.5/Qwen3, NousHermes) inside ChatML turns."""

    name = "hermes"
    markers = ("<tool_call>",)
    end_tokens = ("<|im_end|>", "<|endoftext|>")

    def parse_with_ids(self, text: str) -> list[tuple[Parsed, Optional[str]]]:
        out: list[tuple[Parsed, Optional[str]]] = []
        rest = text
        while "<tool_call>" in rest:
            body, closed, rest = rest.split("<tool_call>", 1)[1].partition("</tool_call>")
            try:
                call = _call(json.loads(self._strip_end(body)), ("arguments",))
            except (ValueError, AttributeError) as e:
                if not closed:  # an open block that is no complete call: text, not an attempt at one
                    break
                out.append((_malformed(e), None))
                continue
            out.append((call, None))
        return out


class Llama3JsonFormat(ToolFormat):
    """Llama 3.1-3.3 JSON tool calls: the whole turn is `{"name": ..., "parameters": {...}}`."""

    name = "llama3_json"
    markers = ("<|python_tag|>", "ipython")
    end_tokens = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")

    def parse_with_ids(self, text: str) -> list[tuple[Parsed, Optional[str]]]:
        text = self._strip_end(text)
        if text.startswith("<|python_tag|>"):
            text = text[len("<|python_tag|>"):].lstrip()
        if not text.startswith("{"):
            return []
        out: list[tuple[Parsed, Optional[str]]] = []
        decoder, pos = json.JSONDecoder(), 0
        while pos < len(text):
            try:
                obj, end = decoder.raw_decode(text, pos)
                out.append((_call(obj, ("parameters", "arguments")), None))
            except ValueError as e:
                out.append((_malformed(e), None))
                break
            pos = end
            while pos < len(text) and text[pos] in " \t\n;":
                pos += 1
        return out


class MistralFormat(ToolFormat):
    """Mistral tool calls after `[TOOL_CALLS]`: a JSON list (v0.3) or `name[ARGS]{json}` items."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    end_tokens = ("</s>",)

    def parse_with_ids(self, text: str) -> list[tuple[Parsed, Optional[str]]]:
        text = self._strip_end(text)
        if "[TOOL_CALLS]" not in text:
            return []
        items = [s.strip() for s in text.split("[TOOL_CALLS]")[1:]]
        out: list[tuple[Parsed, Optional[str]]] = []
        for item in items:
            try:
                if item.startswith("["):  # v0.3: a JSON list of calls
                    calls, _ = json.JSONDecoder().raw_decode(item)
                    if not isinstance(calls, list):
                        raise ValueError("[TOOL_CALLS] is followed by a JSON list")
                    for obj in calls:
                        try:
                            call_id = obj.get("id") if isinstance(obj.get("id"), str) else None
                            out.append((_call(obj, ("arguments",)), call_id))
                        except (ValueError, AttributeError) as e:
                            out.append((_malformed(e), None))
                else:  # v11: name[ARGS]{json}
                    name, sep, args = item.partition("[ARGS]")
                    if not sep:
                        raise ValueError("expected name[ARGS]{...}")
                    obj, _ = json.JSONDecoder().raw_decode(args.strip())
                    out.append((_call({"name": name.strip(), "arguments": obj}, ("arguments",)), None))
            except ValueError as e:
                out.append((_malformed(e), None))
        return out


FORMATS: dict[str, type[ToolFormat]] = {f.name: f for f in (HermesFormat, Llama3JsonFormat, MistralFormat)}
CHOICES = ("auto", *FORMATS)


def template_text(chat_template) -> Optional[str]:
    """One template's source from a tokenizer's `chat_template`: a string, or named templates (a
    dict, or tokenizer_config.json's list of {name, template}) where the "tool_use" one is what
    transformers renders when given tools, else "default"."""
    if isinstance(chat_template, list):
        chat_template = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)}
    if isinstance(chat_template, dict):
        return chat_template.get("tool_use") or chat_template.get("default")
    return chat_template or None


def model_template(source: str) -> tuple[Optional[str], bool]:
    """(the chat template of the tokenizer at `source`, whether it could be read without loading
    the tokenizer): builtin presets' byte tokenizer, or a local directory's chat_template.jinja,
    chat_template.json or tokenizer_config.json. (None, False) for a hub id."""
    import os

    from mrl.models.facts import builtin_preset

    if builtin_preset(source) is not None:
        from mrl.models.tokenizer import CHATML

        return CHATML, True
    if not os.path.isdir(source):
        return None, False
    jinja = os.path.join(source, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja) as f:
            return f.read(), True
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = os.path.join(source, name)
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    found = template_text(json.load(f).get("chat_template"))
            except (OSError, ValueError, AttributeError):
                continue
            if found:
                return found, True
    return None, True


def detect_format(template: str) -> list[str]:
    """The formats whose call markers `template` (a chat template's source) writes."""
    return [name for name, f in FORMATS.items() if any(m in template for m in f.markers)]


def template_problem(fmt: str, template: Optional[str], origin: str) -> Optional[str]:
    """Why `fmt` cannot run with this chat template (one line), or None. `origin` names where the
    template came from; a format other than the one the template writes is refused, since the
    model would be trained on tool turns its template never showed it."""
    if not template:
        return f"{origin} has no chat template; multi-turn turns are built with the model's own template"
    found = detect_format(template)
    if fmt == "auto":
        if len(found) == 1:
            return None
        what = "none of" if not found else "several of"
        return (f"format = 'auto' but the chat template of {origin} writes {what} the known tool-call formats "
                f"({', '.join(found or FORMATS)}); name one")
    if fmt not in FORMATS:
        return f"unknown format {fmt!r} (known: {', '.join(CHOICES)})"
    if fmt not in found:
        markers = " or ".join(repr(m) for m in FORMATS[fmt].markers)
        return (f"format = {fmt!r} but the chat template of {origin} has no {markers}"
                + (f"; it writes {', '.join(found)} calls" if found else "; it renders no tool calls"))
    return None


def resolve_format(fmt: str, template: Optional[str], origin: str) -> ToolFormat:
    """The parser for `fmt` (`auto`: the template's), or a UserError naming the key."""
    from mrl.errors import UserError

    template = template_text(template)
    problem = template_problem(fmt, template, origin)
    if problem:
        raise UserError(f"rollout.multi_turn.format: {problem}")
    return FORMATS[detect_format(template)[0] if fmt == "auto" else fmt]()
