"""Token-in/token-out tool turns: the trainer sees the engine's own ids, turn by turn, for two chat
templates (ChatML/Hermes and Llama 3); template checks; tool-call parsers by format; schemas."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mrl.batch import Batch
from mrl.errors import UserError
from mrl.models.tokenizer import byte_tokenizer
from mrl.rollout.multi_turn import MultiTurnRollout
from mrl.rollout.tool_formats import (HermesFormat, Llama3JsonFormat, MistralFormat, detect_format, model_template,
                                      resolve_format, template_problem)
from mrl.rollout.tools import ToolCall, ToolRunner
from mrl.rollout.turns import TurnTemplate
from mrl.rollout.types import Response, Sampling
from tests.rollout.test_multi_turn import ScriptedEngine

HERE = Path(__file__).parent
TOOLS = str(HERE / "tools_for_tests.py")
REPO = HERE.parents[1]

# Llama 3.1's template, its tool parts verbatim (system header, tools in the first user message,
# one JSON call per assistant turn, tool results as ipython turns, tojson of string contents).
LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n" }}
{{- system_message }}{{- "<|eot_id|>" }}
{%- if tools is not none %}
    {%- set first_user_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' + tool_call.arguments | tojson + "}<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}{{- message.content | tojson }}
        {%- else %}{{- message.content }}{%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""
LLAMA3_SPECIALS = ("<|end_of_text|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                   "<|eom_id|>", "<|python_tag|>")

# Qwen3's assistant rendering: the last turn after the user query keeps a (possibly empty) think
# block, an earlier one only when it has reasoning
QWEN3 = """{%- for message in messages %}
{%- if message.role == 'user' %}{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
    {%- set content = message.content %}{%- set reasoning_content = '' %}
    {%- if '</think>' in content %}
        {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
        {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
    {%- endif %}
    {%- if loop.last or reasoning_content %}
        {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content }}
    {%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}
    {{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
    {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
{#- <tool_call> #}"""

# DeepSeek-R1-style: earlier assistant turns lose their reasoning
DROPS_REASONING = QWEN3.replace("{%- if loop.last or reasoning_content %}", "{%- if false %}")

# Mistral v0.3's tool results (call ids of 9 characters)
MISTRAL = """{{- bos_token }}{%- for message in messages %}
{%- if message.role == 'user' %}{{- '[INST] ' + message.content + '[/INST]' }}
{%- elif message.role == 'assistant' %}{{- ' ' + message.content|trim + eos_token }}
{%- elif message.role == 'tool' %}
    {%- if message.tool_call_id is not defined or message.tool_call_id|length != 9 %}
        {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{%- endif %}
    {{- '[TOOL_RESULTS] {"content": ' + message.content|string + ', "call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
{%- endif %}{%- endfor %}{#- [TOOL_CALLS] #}"""


def bpe_tokenizer(template: str, specials: tuple[str, ...], merges=(("a", "b"),)):
    """A byte-level BPE tokenizer with a few merges (so a text has non-canonical spellings) and a template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: byte for byte, ch in bytes_to_unicode().items()}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=specials[0], bos_token=specials[1],
                                   pad_token=specials[0], additional_special_tokens=list(specials[2:]))
    fast.chat_template = template
    return fast


class RecordingEngine(ScriptedEngine):
    """Answers turn k with the ids script[k] (any spelling, canonical or not); records what it saw and produced.
    Weight, sleep and shutdown calls are ScriptedEngine's no-ops."""

    def __init__(self, script):
        self.script, self.calls = script, []   # calls: (context ids, produced ids, their log-probs)

    def generate(self, prompt_token_ids, sampling):
        out = []
        for i, ctx in enumerate(prompt_token_ids):
            turn = sum(1 for c in self.calls if len(c[0]) < len(ctx) and ctx[:len(c[0])] == c[0])
            ids = self.script[turn][:sampling.max_tokens]
            lps = [-0.1 * (k + 1) for k in range(len(ids))]
            self.calls.append((list(ctx), list(ids), lps))
            out.append(Response(i, list(ids), lps, "stop"))
        return out

    def sequence_logprobs(self, token_ids):
        return [[0.0] * (len(t) - 1) for t in token_ids]


def _spelled_apart(tok, text: str) -> list[int]:
    """`text` as one token per byte: what an engine may sample, never what `encode` gives for 'ab'."""
    return [tok.convert_tokens_to_ids(ch) for ch in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)[0][0]]


CASES = {
    # ChatML + Hermes (the builtin byte tokenizer): the engine writes the *characters* "<|im_end|>"
    # inside its text, which re-tokenizing would turn into the special token
    "chatml-hermes": dict(
        tok=lambda: byte_tokenizer(), format="hermes", end="<|im_end|>",
        turns=lambda tok, end: [
            list("lit <|im_end|> ".encode())   # byte tokens: the id of a byte is its value
            + tok.encode('<tool_call>{"name": "echo", "arguments": {"text": "ab"}}</tool_call>' + end, add_special_tokens=False),
            tok.encode("done" + end, add_special_tokens=False)]),
    # Llama 3 JSON: the engine spells "ab" as two tokens where the tokenizer's BPE merges them
    "llama3-json": dict(
        tok=lambda: bpe_tokenizer(LLAMA3, LLAMA3_SPECIALS), format="llama3_json", end="<|eot_id|>",
        turns=lambda tok, end: [
            _spelled_apart(tok, '{"name": "echo", "parameters": {"text": "ab"}}') + tok.encode(end, add_special_tokens=False),
            _spelled_apart(tok, "ab done") + tok.encode(end, add_special_tokens=False)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_trainer_sees_the_engines_token_ids_turn_by_turn(case):
    c = CASES[case]
    tok = c["tok"]()
    script = c["turns"](tok, c["end"])
    engine = RecordingEngine(script)
    mt = MultiTurnRollout(engine, tok, ToolRunner([f"{TOOLS}:echo"]), max_assistant_turns=3, format=c["format"])
    prompt = tok.apply_chat_template([{"role": "user", "content": "say ab"}], tools=mt.tools.schemas(),
                                     add_generation_prompt=True, tokenize=False)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    [r] = mt.generate([prompt_ids], Sampling(n=1, max_tokens=1000))
    assert r.info["assistant_turns"] == 2 and r.info["tool_turns"] == 1 and r.info["tool_errors"] == 0

    # the trainer's batch row is the prompt and the response, id for id
    batch = Batch.from_sequences([prompt_ids], [r.token_ids], loss_masks=[r.loss_mask])
    row = batch["response_ids"][0, :len(r.token_ids)].tolist()
    assert row == r.token_ids and batch["response_mask"][0, :len(r.token_ids)].tolist() == r.loss_mask

    # turn by turn: each engine call saw exactly prompt + the response so far, and what it produced
    # sits in the response unchanged, with its log-probs and loss mask 1; between them, mask 0 and log-prob 0
    pos = 0
    for k, (ctx, produced, lps) in enumerate(engine.calls):
        assert ctx == prompt_ids + r.token_ids[:len(ctx) - len(prompt_ids)]
        gap = len(ctx) - len(prompt_ids) - pos
        assert (k == 0) == (gap == 0)
        assert r.loss_mask[pos:pos + gap] == [0] * gap and r.logprobs[pos:pos + gap] == [0.0] * gap
        pos += gap
        assert r.token_ids[pos:pos + len(produced)] == produced
        assert r.loss_mask[pos:pos + len(produced)] == [1] * len(produced) and r.logprobs[pos:pos + len(produced)] == lps
        pos += len(produced)
    assert pos == len(r.token_ids)

    # the tool turn is the template's own text for this conversation: the prompt, the response
    # decoded and the final turn's close render the same text as the whole conversation
    first, second = (tok.decode(p) for _, p, _ in engine.calls)
    end = c["end"]
    messages = [{"role": "user", "content": "say ab"}, {"role": "assistant", "content": first[:-len(end)]},
                {"role": "tool", "content": "echo:ab", "name": "echo", "tool_call_id": "call00000"},
                {"role": "assistant", "content": second[:-len(end)]}]
    whole = tok.apply_chat_template(messages, tools=mt.tools.schemas(), tokenize=False)
    assert whole.startswith(tok.decode(prompt_ids + r.token_ids)), (whole, tok.decode(prompt_ids + r.token_ids))

    # ...yet re-tokenizing that text would not give the engine's ids: the test can tell the two apart
    assert tok.encode(tok.decode(prompt_ids + r.token_ids), add_special_tokens=False) != prompt_ids + r.token_ids


def test_chatml_tool_turn_is_the_former_hard_coded_text():
    tok = byte_tokenizer()
    turns = TurnTemplate(tok, ToolRunner([f"{TOOLS}:echo"]).schemas())
    generated = tok.encode("x<|im_end|>", add_special_tokens=False)
    two = [{"role": "tool", "content": "A"}, {"role": "tool", "content": "B"}]
    assert tok.decode(turns.tool_turn_ids(generated, two)) == (
        "\n<|im_start|>user\n<tool_response>\nA\n</tool_response>\n<tool_response>\nB\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    # a turn that stopped before its end-of-turn token gets it from the template (mask 0)
    assert tok.decode(turns.tool_turn_ids(tok.encode("x", add_special_tokens=False), two[:1])).startswith(
        "<|im_end|>\n<|im_start|>user")
    assert turns.notes == []


def test_templates_that_alter_earlier_turns_are_explained_and_broken_ones_refused():
    qwen3 = TurnTemplate(bpe_tokenizer(QWEN3, ("<|endoftext|>", "<s>", "<|im_start|>", "<|im_end|>")))
    assert len(qwen3.notes) == 1 and "renders the last assistant turn differently" in qwen3.notes[0]
    # and its tool turn is still the ChatML one, appended after the generated <|im_end|>
    tok = qwen3.tokenizer
    ids = qwen3.tool_turn_ids(tok.encode("<think>\nr\n</think>\n\nx<|im_end|>", add_special_tokens=False),
                              [{"role": "tool", "content": "R"}])
    assert tok.decode(ids) == "\n<|im_start|>user\n<tool_response>\nR\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    drops = TurnTemplate(bpe_tokenizer(DROPS_REASONING, ("<|endoftext|>", "<s>", "<|im_start|>", "<|im_end|>")))
    assert any("drops the reasoning" in n for n in drops.notes)

    changes_close = QWEN3.replace("{{- '<|im_end|>\\n' }}", "{{- '<|im_end|>\\n' if loop.last else '<|im_sep|>' }}")
    with pytest.raises(UserError, match="changes the end of an assistant turn"):
        TurnTemplate(bpe_tokenizer(changes_close, ("<|endoftext|>", "<s>", "<|im_start|>", "<|im_end|>", "<|im_sep|>")))
    no_content = "{% for m in messages %}{{ m.role }}{% endfor %}"
    with pytest.raises(UserError, match="content verbatim"):
        TurnTemplate(bpe_tokenizer(no_content, ("<|endoftext|>", "<s>")))
    with pytest.raises(UserError, match="no chat template"):
        TurnTemplate(bpe_tokenizer(None, ("<|endoftext|>", "<s>")))


def test_mistral_tool_results_carry_the_models_call_ids():
    tok = bpe_tokenizer(MISTRAL, ("</s>", "<s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"))
    engine = RecordingEngine([
        tok.encode('[TOOL_CALLS] [{"name": "echo", "arguments": {"text": "hi"}, "id": "abcDEF123"}]</s>',
                   add_special_tokens=False),
        tok.encode(" bye</s>", add_special_tokens=False)])
    mt = MultiTurnRollout(engine, tok, ToolRunner([f"{TOOLS}:echo"]), format="auto")
    assert isinstance(mt.format, MistralFormat)
    [r] = mt.generate([tok.encode("<s>[INST] hi[/INST]", add_special_tokens=False)], Sampling(max_tokens=500))
    tool = tok.decode([t for t, m in zip(r.token_ids, r.loss_mask) if m == 0])
    assert tool == '[TOOL_RESULTS] {"content": echo:hi, "call_id": "abcDEF123"}[/TOOL_RESULTS]'
    assert r.info["assistant_turns"] == 2


def test_hermes_llama3_and_mistral_parsers():
    h = HermesFormat().parse('x <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "g", '
                             '"arguments": "{\\"b\\": 2}"}</tool_call> <tool_call>{"name": "unterminated"')
    assert h == [ToolCall("f", {"a": 1}), ToolCall("g", {"b": 2})]
    # a block a stop string left open counts when its JSON is complete
    assert HermesFormat().parse('<tool_call>\n{"name": "f", "arguments": {}}\n<|im_end|>') == [ToolCall("f", {})]

    ll = Llama3JsonFormat()
    assert ll.parse("The answer is 4.<|eot_id|>") == []
    assert ll.parse('<|python_tag|>{"name": "f", "parameters": {"a": 1}}<|eom_id|>') == [ToolCall("f", {"a": 1})]
    assert ll.parse('{"name": "f", "arguments": {"a": 1}}; {"name": "g", "parameters": {}}<|eot_id|>') == [
        ToolCall("f", {"a": 1}), ToolCall("g", {})]
    bad = ll.parse('{"name": "f", "parameters": [1]}')
    assert len(bad) == 1 and bad[0].startswith("error: malformed tool call")
    assert ll.parse('{"name": "f", "parameters": {')[0].startswith("error: malformed")

    m = MistralFormat()
    assert m.parse("no calls</s>") == []
    assert m.parse_with_ids('[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}, "id": "abcdefghi"}, '
                            '{"name": "g", "arguments": {}}]</s>') == [(ToolCall("f", {"a": 1}), "abcdefghi"),
                                                                       (ToolCall("g", {}), None)]
    assert m.parse('[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}</s>') == [ToolCall("f", {"a": 1}), ToolCall("g", {})]
    assert m.parse("[TOOL_CALLS] f(a=1)")[0].startswith("error: malformed")


def test_format_detection_and_one_line_refusals():
    from mrl.models.tokenizer import CHATML

    assert detect_format(CHATML) == ["hermes"] and detect_format(LLAMA3) == ["llama3_json"]
    assert detect_format(MISTRAL) == ["mistral"] and detect_format("{{ messages }}") == []
    assert isinstance(resolve_format("auto", LLAMA3, "t"), Llama3JsonFormat)
    assert isinstance(resolve_format("auto", {"default": "x", "tool_use": CHATML}, "t"), HermesFormat)
    assert template_problem("hermes", CHATML, "t") is None
    for fmt, template, words in (("llama3_json", CHATML, "has no '<|python_tag|>' or 'ipython'; it writes hermes calls"),
                                 ("hermes", "{{ messages }}", "renders no tool calls"),
                                 ("auto", "{{ messages }}", "none of"), ("hermes", None, "has no chat template")):
        line = template_problem(fmt, template, "org/model")
        assert words in line and "\n" not in line, line
    with pytest.raises(UserError, match="rollout.multi_turn.format"):
        MultiTurnRollout(RecordingEngine([]), bpe_tokenizer(LLAMA3, LLAMA3_SPECIALS), ToolRunner([]), format="hermes")


def test_model_template_reads_tokenizer_files_without_loading_them(tmp_path):
    assert model_template("builtin:tiny-qwen2")[0].count("<tool_call>") >= 1
    assert model_template("org/not-a-local-dir") == (None, False)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": "{{ messages }}"}, {"name": "tool_use", "template": LLAMA3}]}))
    assert model_template(str(tmp_path)) == (LLAMA3, True)
    (tmp_path / "chat_template.jinja").write_text(MISTRAL)
    assert model_template(str(tmp_path)) == (MISTRAL, True)


def test_tool_schemas_come_from_signature_and_docstring(tmp_path):
    src = tmp_path / "t.py"
    src.write_text('import nonexistent_module_never_imported\n\n'
                   'def lookup(city: str, days: int = 1, *, metric: bool = True, extra=None):\n'
                   '    """Weather forecast for a city.\n\n    Args:\n        city: the city name\n'
                   '        days: how many days\n    """\n')
    [schema] = ToolRunner([f"{src}:lookup"]).schemas()
    assert schema == {"type": "function", "function": {
        "name": "lookup", "description": "Weather forecast for a city.",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": "the city name"},
            "days": {"type": "integer", "description": "how many days"},
            "metric": {"type": "boolean"}, "extra": {}}}}}
    [calc] = ToolRunner([str(REPO / "jobs/tools/calculator.py") + ":calculator"]).schemas()
    assert calc["function"]["name"] == "calculator" and calc["function"]["parameters"]["required"] == ["expression"]


def test_chat_prompts_of_a_multi_turn_job_list_its_tools():
    from mrl.config.loader import load
    from mrl.data.prompts import tokenize_rows
    from mrl.data.rows import PromptRow
    from mrl.rollout.multi_turn import prompt_tools

    on = ["rollout.multi_turn.enable=true", 'rollout.multi_turn.tools=["jobs/tools/calculator.py:calculator"]']
    spec, _ = load(REPO / "jobs/quickstart_cpu.toml", [*on, "data.chat_template=true"])
    tools = prompt_tools(spec)
    assert [t["function"]["name"] for t in tools] == ["calculator"]
    assert prompt_tools(load(REPO / "jobs/quickstart_cpu.toml", on)[0]) is None   # raw-text prompts: no template
    row = PromptRow(prompt="2+2?", answer="4", data_source="t", origin="t")
    ds = tokenize_rows([row], byte_tokenizer(), max_prompt_tokens=4096, overflow="error", chat_template=True, tools=tools)
    text = ds.items[0].text
    assert '"name": "calculator"' in text and text.endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_validate_refuses_a_format_the_template_does_not_write_in_one_line(tmp_path):
    from mrl.config.loader import load
    from mrl.errors import SpecError

    on = ["rollout.multi_turn.enable=true", 'rollout.multi_turn.tools=["jobs/tools/calculator.py:calculator"]']
    for fmt in ("hermes", "auto"):
        load(REPO / "jobs/quickstart_cpu.toml", [*on, f"rollout.multi_turn.format={fmt}"])
    with pytest.raises(SpecError) as e:
        load(REPO / "jobs/quickstart_cpu.toml", [*on, "rollout.multi_turn.format=llama3_json"])
    [problem] = e.value.problems
    assert "rollout.multi_turn.format: format = 'llama3_json' but the chat template of builtin:tiny-qwen2" in problem
    assert "\n" not in problem
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    with pytest.raises(SpecError, match="renders no tool calls"):
        load(REPO / "jobs/quickstart_cpu.toml", [*on, f"model.tokenizer={tmp_path}"])
