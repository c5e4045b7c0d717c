"""Chat templates, over-long prompts, and whole datasets from generators (incl. reasoning-gym)."""
import pytest

from mrl.data.config import DataConfig
from mrl.data.prompts import tokenize_rows
from mrl.data.rows import PromptRow
from mrl.data.source import load_prompts
from mrl.data.template import render_prompt
from mrl.errors import UserError


def row(prompt, i=0):
    return PromptRow(prompt=prompt, answer="1", data_source="t", origin=f"t row {i}")


def test_chat_template_with_system_prompt(tokenizer):
    text = render_prompt("2+2?", tokenizer, chat_template=True, system_prompt="Be brief.")
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    # messages that already start with a system message keep theirs
    msgs = [{"role": "system", "content": "Own."}, {"role": "user", "content": "hi"}]
    assert render_prompt(msgs, tokenizer, chat_template=True, system_prompt="Be brief.").startswith("<|im_start|>system\nOwn.<|im_end|>")


def test_raw_prompts_and_template_errors(tokenizer):
    assert render_prompt("2+2?", tokenizer, chat_template=False) == "2+2?"
    assert render_prompt("2+2?", tokenizer, chat_template=False, system_prompt="S") == "S\n\n2+2?"
    with pytest.raises(UserError, match="t row 3: a chat-message prompt needs data.chat_template = true"):
        render_prompt([{"role": "user", "content": "x"}], tokenizer, chat_template=False, origin="t row 3")
    bare = type("Tok", (), {"chat_template": None})()
    with pytest.raises(UserError, match="no chat template; set data.chat_template = false"):
        render_prompt("x", bare, chat_template=True)


def test_special_tokens_added_once(tokenizer):
    bos = tokenizer.bos_token_id
    raw = tokenize_rows([row("hello")], tokenizer, max_prompt_tokens=100, overflow="error", chat_template=False)
    chat = tokenize_rows([row("hello")], tokenizer, max_prompt_tokens=100, overflow="error", chat_template=True)
    assert raw[0].token_ids[0] == bos  # a raw prompt gets the tokenizer's BOS
    assert bos not in chat[0].token_ids  # the template wrote its own special tokens; none added
    assert tokenizer.decode(chat[0].token_ids) == chat[0].text


def test_overflow_policies(tokenizer):
    rows = [row("hi", 0), row("What is 17 + 5? " * 10, 1), row("ok", 2)]
    lengths = [len(tokenizer(r.prompt)["input_ids"]) for r in rows]
    limit = 10
    assert lengths[0] <= limit < lengths[1] and lengths[2] <= limit
    dropped = tokenize_rows(rows, tokenizer, max_prompt_tokens=limit, overflow="drop", chat_template=False)
    assert [p.prompt for p in dropped.items] == ["hi", "ok"] and [p.index for p in dropped.items] == [0, 1]
    assert dropped.stats == {"prompts_overlong_dropped": 1, "prompts_truncated": 0, "prompts": 2}
    cut = tokenize_rows(rows, tokenizer, max_prompt_tokens=limit, overflow="truncate_left", chat_template=False)
    full = tokenizer(rows[1].prompt)["input_ids"]
    assert list(cut[1].token_ids) == full[-limit:]  # the end of the prompt is kept
    assert cut.stats["prompts_truncated"] == 1 and cut.stats["prompts"] == 3
    with pytest.raises(UserError, match=rf"t row 1: prompt has {lengths[1]} tokens > data.max_prompt_tokens 10"):
        tokenize_rows(rows, tokenizer, max_prompt_tokens=limit, overflow="error", chat_template=False)


def test_generator_dataset_counts_and_is_deterministic(tokenizer):
    cfg = DataConfig(generator="mrl.data.generators:arithmetic", generator_size=20, seed=3, chat_template=False,
                     max_prompt_tokens=64)
    a, b = load_prompts(cfg, tokenizer), load_prompts(cfg, tokenizer)
    assert [p.token_ids for p in a.items] == [p.token_ids for p in b.items] and len(a) == 20
    assert a.stats == {"rows_read": 20, "rows_bad_prompt": 0, "rows_missing_answer": 0,
                       "prompts_overlong_dropped": 0, "prompts_truncated": 0, "prompts": 20}
    val = load_prompts(cfg, tokenizer, "val")
    assert [p.prompt for p in val.items] != [p.prompt for p in a.items]  # another seed


def test_reasoning_gym_generator(tokenizer):
    cfg = DataConfig(generator="reasoning_gym:chain_sum", generator_size=8, seed=1, max_prompt_tokens=256,
                     generator_kwargs={"min_terms": 2, "max_terms": 2}, system_prompt="Answer in <answer> tags.")
    ds = load_prompts(cfg, tokenizer)
    item = ds[0]
    assert item.data_source == "reasoning_gym/chain_sum"
    entry = item.extra["reasoning_gym"]["entry"]
    assert entry["question"] == item.prompt and entry["answer"] == item.answer
    assert item.text.startswith("<|im_start|>system\nAnswer in <answer> tags.")
    assert all(p.prompt.count("+") + p.prompt.count("-") == 1 for p in ds.items)  # 2 terms, as asked
    with pytest.raises(UserError, match="no task 'chain_sums'; did you mean 'chain_sum'"):
        load_prompts(DataConfig(generator="reasoning_gym:chain_sums"), tokenizer)


def test_generator_problem_checks_tasks_and_functions():
    from mrl.data.source import generator_problem

    assert generator_problem("reasoning_gym:gsm_symbolic") is None
    assert generator_problem("mrl.data.generators:arithmetic") is None
    assert "did you mean 'basic_arithmetic'" in generator_problem("reasoning_gym:basic_arithmetics")
    assert "must accept 2 positional arguments" in generator_problem("jobs/rewards/arithmetic.py:score")


def test_a_prompt_too_large_to_fit_is_never_tokenized(tokenizer, monkeypatch):
    """A cell whose bytes exceed (max tokens x BYTES_PER_TOKEN) cannot fit the model whatever its
    tokens: it is refused ("error") or dropped and counted ("drop", "truncate_left") before the
    tokenizer sees it (a 200 MB cell would otherwise take gigabytes to tokenize)."""
    from mrl.data import prompts as prompts_mod

    big = "x" * (10 * prompts_mod.BYTES_PER_TOKEN + 1)
    monkeypatch.setattr(tokenizer, "model_max_length", 10, raising=False)
    seen = []
    real = prompts_mod.encode_prompt
    monkeypatch.setattr(prompts_mod, "encode_prompt", lambda text, *a, **k: seen.append(len(text)) or real(text, *a, **k))
    rows = [row("hi", 0), row(big, 1)]
    for overflow in ("drop", "truncate_left"):
        seen.clear()
        out = tokenize_rows(rows, tokenizer, max_prompt_tokens=10, overflow=overflow, chat_template=False)
        assert [p.prompt for p in out.items] == ["hi"] and out.stats["prompts_oversized_dropped"] == 1
        assert max(seen) < len(big)                 # the big cell never reached the tokenizer
    with pytest.raises(UserError, match=r"t row 1: prompt has 321 bytes, more than 320 = 10 tokens x 32 bytes"):
        tokenize_rows(rows, tokenizer, max_prompt_tokens=10, overflow="error", chat_template=False)
