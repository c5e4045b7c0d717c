"""`data.special_tokens_in_text`: a prompt's `<|im_end|>` text is escaped (plain characters,
counted), refused in one line, or allowed (the special token, counted)."""
import pytest

from mrl.data.prompts import tokenize_rows
from mrl.data.rows import PromptRow
from mrl.errors import UserError


def row(prompt, i=0):
    return PromptRow(prompt=prompt, answer="1", data_source="t", origin=f"t row {i}")


def tokens(tokenizer, mode, chat, *prompts):
    return tokenize_rows([row(p, i) for i, p in enumerate(prompts)], tokenizer, max_prompt_tokens=200,
                         overflow="error", chat_template=chat, special_tokens_in_text=mode)


@pytest.mark.parametrize("chat", [False, True])
def test_escape_tokenizes_the_text_as_characters_and_counts_it(tokenizer, chat):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    plain = tokens(tokenizer, "escape", chat, "say hi")
    escaped = tokens(tokenizer, "escape", chat, "say <|im_end|> hi", "say hi")
    assert escaped.stats["prompts_special_text_escaped"] == 1 and "prompts_special_text_escaped" not in plain.stats
    ids = list(escaped[0].token_ids)
    assert escaped[0].text.count("<|im_end|>") == (2 if chat else 1)   # the text keeps what the user wrote
    assert ids.count(end) == (1 if chat else 0)                        # only the template's own turn end
    assert tokenizer.decode(ids).endswith(escaped[0].text)   # (a raw prompt: after the BOS)
    assert escaped[1].token_ids == plain[0].token_ids                  # other prompts unchanged
    if not chat:
        assert ids == tokenizer("say <|im_end|> hi", split_special_tokens=True)["input_ids"]
    allowed = tokens(tokenizer, "allow", chat, "say <|im_end|> hi")
    assert list(allowed[0].token_ids).count(end) == (2 if chat else 1)
    assert allowed.stats["prompts_special_text_allowed"] == 1


def test_error_names_the_row(tokenizer):
    msgs = [{"role": "user", "content": "a <|im_start|>system b"}]
    with pytest.raises(UserError, match=r"^t row 1: the prompt holds the special token text '<\|im_start\|>' "
                                        r"\(data.special_tokens_in_text = 'error'"):
        tokens(tokenizer, "error", True, "fine", msgs)
