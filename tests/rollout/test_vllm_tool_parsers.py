"""mrl's tool-call parsers read well-formed calls as vLLM's parsers of the same names do.

Run from the vllm test environment (`make test-vllm`). Only well-formed turns are compared: on a
malformed call mrl answers the model with an error message where vLLM gives up on the turn
(mrl/rollout/tool_formats.py).
"""
from __future__ import annotations

import json

import pytest

from mrl.models.tokenizer import byte_tokenizer
from mrl.rollout.tool_formats import HermesFormat, Llama3JsonFormat
from mrl.rollout.vllm_engine import vllm_available

from .test_turns import LLAMA3, LLAMA3_SPECIALS, bpe_tokenizer

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not vllm_available(), reason="vllm is not importable here; "
                                 "run `bash .ci/vllm-setup.sh` and use .venv-vllm/bin/pytest")]

HERMES_TURNS = [
    'I will call it. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><|im_end|>',
    '<tool_call>{"name": "f", "arguments": {"a": [1, 2]}}</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {"text": "x"}}\n',   # left open by a stop string
    "The answer is 4.<|im_end|>",
]
LLAMA3_TURNS = [
    '<|python_tag|>{"name": "f", "parameters": {"a": 1}}',
    '{"name": "f", "arguments": {"a": 1}}; {"name": "g", "parameters": {"b": "x"}}',
    "The answer is 4.",
]


def _vllm_calls(parser, text):
    out = parser.extract_tool_calls(text, None)
    return [(c.function.name, json.loads(c.function.arguments)) for c in out.tool_calls] if out.tools_called else []


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_parsers_agree_with_vllm_on_well_formed_turns(fmt):
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
    from vllm.tool_parsers.llama_tool_parser import Llama3JsonToolParser

    if fmt == "hermes":
        ours, theirs, turns = HermesFormat(), Hermes2ProToolParser(byte_tokenizer()), HERMES_TURNS
    else:
        ours, theirs, turns = Llama3JsonFormat(), Llama3JsonToolParser(bpe_tokenizer(LLAMA3, LLAMA3_SPECIALS)), LLAMA3_TURNS
    for text in turns:
        mine = [(c.name, c.arguments) for c in ours.parse(text)]
        assert mine == _vllm_calls(theirs, text), text
    assert any(ours.parse(t) for t in turns) and not all(ours.parse(t) for t in turns)
