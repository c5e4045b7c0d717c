"""The job's tokenizer: the checkpoint's own, or a byte-level one for the builtin tiny presets.

Builtin presets have no tokenizer files; they get a byte-level tokenizer (token id = byte value,
then `<|endoftext|>` (eos and pad), `<|im_start|>`, `<|im_end|>`) with a ChatML template (Hermes
tool turns when given tools), built
in memory with `tokenizers`. Ids beyond it (the preset's vocabulary is larger) decode to nothing.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

from mrl.errors import UserError
from mrl.models.config import ModelConfig
from mrl.models.facts import builtin_preset

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: ids 259.. of the byte tokenizer of a vision-language preset (Qwen2.5-VL's placeholder specials)
VISION_SPECIALS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
# ChatML; with tools (transformers renders with trim_blocks, hence {{ '\\n' }} after a tag), Qwen2.5's Hermes tool turns (a system block listing them, <tool_call> in
# assistant turns, consecutive tool messages in one user turn of <tool_response> blocks)
CHATML = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}</tools>"
    "\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'system' and tools and loop.first %}"
    "{% elif m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}{{ '\\n' }}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@lru_cache(maxsize=None)
def byte_tokenizer(vision: bool = False):
    """A byte-level `PreTrainedTokenizerFast` (259 ids) for the builtin presets; with `vision`,
    Qwen-VL's placeholder specials follow (ids 259-262, `VISION_SPECIALS`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: byte for byte, ch in bytes_to_unicode().items()}
    specials = SPECIALS + (VISION_SPECIALS if vision else ())
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0], pad_token=SPECIALS[0],
                                   additional_special_tokens=list(specials[1:]))
    fast.chat_template = CHATML
    return fast


def load_tokenizer(model: ModelConfig) -> Any:
    """`model.tokenizer`, else the checkpoint at `model.path`, else the byte tokenizer for presets."""
    source = model.tokenizer or model.path
    if builtin_preset(source) is not None:
        from mrl.models.facts import BUILTIN_PRESETS
        from mrl.models.vlm import VLM_MODEL_TYPES

        return byte_tokenizer(BUILTIN_PRESETS.get(builtin_preset(source), {}).get("model_type") in VLM_MODEL_TYPES)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=model.trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"model.tokenizer: cannot load a tokenizer from {source!r} ({str(e).splitlines()[0]})") from None
