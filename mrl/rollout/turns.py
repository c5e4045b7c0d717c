"""Token ids of a tool turn, from the model's own chat template, without re-tokenizing the past.

A multi-turn response is the engine's token ids for each assistant turn, exactly as generated,
and between them the tokens the chat template writes for the tool messages and the next
assistant header. Those are found by rendering a probe conversation (a user message, then an
assistant turn whose content is a sentinel) with and without the new tool messages
(`apply_chat_template(..., tools=...)`, the second with the generation prompt) and keeping the
token suffix after the sentinel:

    without: ... <sentinel> <close>                      e.g. close = "<|im_end|>\\n" (ChatML)
    with:    ... <sentinel> <close> <tool turn> <header>

The tool turn's ids are `<close> <tool turn> <header>` less its start that the engine already
generated (ChatML: its `<|im_end|>`, so the "\\n" after it comes next; a turn stopped before its
end-of-turn token gets the whole close). The template is assumed to write a tool turn the same
whatever precedes the last assistant turn (true of ChatML/Qwen, Llama 3 and Mistral templates).
Checked on every render: `with` continues `without` token for token after the sentinel, and
the suffix tokenizes alone as it does in context; otherwise the job stops with one line naming
what differs. Earlier turns are never re-tokenized, so text that
would tokenize differently from the ids the engine produced (verl #6501, TRL #5224) cannot
drift between rollout and training.

Templates that render an earlier assistant turn differently once more messages follow (Qwen3
drops the empty `<think></think>` of a non-final turn; DeepSeek-R1-style templates drop the
reasoning of every earlier turn) are detected at start (`notes`): mrl keeps the engine's tokens,
so the trainer sees what the model actually conditioned on, which a re-render of the whole
conversation would not reproduce.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from mrl.errors import UserError

SENTINEL = "MRL_SENTINEL_7f3a"
_REASONING = "MRL_REASONING_7f3a"


def _overlap(generated: Sequence[int], suffix: Sequence[int]) -> int:
    """Longest k such that `generated` ends with suffix[:k]: the part of the template's turn end
    the engine already produced (its end-of-turn token), not to be appended twice."""
    for k in range(min(len(suffix), len(generated)), 0, -1):
        if list(generated[len(generated) - k:]) == list(suffix[:k]):
            return k
    return 0


class TurnTemplate:
    """The chat template's token ids for tool turns (see the module docstring)."""

    def __init__(self, tokenizer: Any, tools: Optional[list[dict]] = None, *, origin: str = "the tokenizer"):
        if not getattr(tokenizer, "chat_template", None) or not hasattr(tokenizer, "apply_chat_template"):
            raise UserError(f"rollout.multi_turn: {origin} has no chat template; multi-turn turns are built with "
                            "the model's own template")
        self.tokenizer, self.tools, self.origin = tokenizer, tools or None, origin
        probe_user = {"role": "user", "content": "probe"}
        self._base = [probe_user, {"role": "assistant", "content": SENTINEL}]
        without = self._render(self._base, generation_prompt=False)
        self._close_text = self._after_sentinel(without, "the probe conversation")
        self._close = self._encode(self._close_text)
        self.notes: list[str] = []
        # what the template does to an earlier assistant turn once a tool message follows it
        probe_tool = [{"role": "tool", "content": "probe", "name": "probe", "tool_call_id": "call00000"}]
        with_tool = self._render(self._base + probe_tool, generation_prompt=True)
        before_without, before_with = without.split(SENTINEL)[0], with_tool.split(SENTINEL)[0]
        if before_with != before_without:
            self.notes.append(f"the chat template of {origin} renders the last assistant turn differently once a tool "
                              "message follows it (e.g. Qwen3 drops an empty <think></think>); mrl keeps the "
                              "engine's tokens for every earlier turn")
        thinking = [probe_user, {"role": "assistant", "content": f"<think>\n{_REASONING}\n</think>\n\n{SENTINEL}"}]
        if _REASONING not in self._render(thinking + probe_tool, generation_prompt=True):
            self.notes.append(f"the chat template of {origin} drops the reasoning of earlier assistant turns; "
                              "mrl keeps it (the tokens the model generated and conditioned on), so a re-rendered "
                              "conversation would differ from the trained one")
        self.tool_turn_ids([], probe_tool)   # fails now, not mid-rollout, when the template does not fit

    def _render(self, messages: list[dict], *, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as e:  # noqa: BLE001 - a template's raise_exception or a jinja error, for the user
            raise UserError(f"rollout.multi_turn: the chat template of {self.origin} cannot render a tool turn "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _after_sentinel(self, text: str, what: str) -> str:
        if text.count(SENTINEL) != 1:
            raise UserError(f"rollout.multi_turn: the chat template of {self.origin} does not render an assistant "
                            f"message's content verbatim ({what}), so its tool turns cannot be located")
        return text.split(SENTINEL)[1]

    def tool_turn_ids(self, generated: Sequence[int], tool_messages: list[dict]) -> list[int]:
        """Ids to append after an assistant turn whose ids were `generated`: the rest of its close,
        the tool messages and the next assistant header, as the template writes them."""
        with_text = self._render(self._base + tool_messages, generation_prompt=True)
        after = self._after_sentinel(with_text, "with tool messages")
        if not after.startswith(self._close_text):
            raise UserError(f"rollout.multi_turn: the chat template of {self.origin} changes the end of an assistant "
                            f"turn when tool messages follow it ({self._close_text!r} becomes "
                            f"{after[:len(self._close_text)]!r}), so tool turns cannot be appended to generated tokens")
        suffix = self._encode(after)
        if suffix[:len(self._close)] != self._close:
            raise UserError(f"rollout.multi_turn: with the tokenizer of {self.origin}, the end of an assistant turn "
                            f"({self._close_text!r}) tokenizes differently when tool messages follow it")
        in_context = self._encode(with_text)
        if in_context[len(in_context) - len(suffix):] != suffix:
            raise UserError(f"rollout.multi_turn: with the tokenizer of {self.origin}, the tool turn "
                            f"{after[:60]!r}... tokenizes differently alone than after the assistant turn")
        return suffix[_overlap(generated, suffix):]
