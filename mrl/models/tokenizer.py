"""The job's tokenizer: the checkpoint's own, or a byte-level one for the builtin tiny presets.

Builtin presets have no tokenizer files; they get a byte-level tokenizer (token id = byte value,
then `<|endoftext|>` (eos and pad), `<|im_start|>`, `<|im_end|>`) with a ChatML template, built
in memory with `tokenizers`. Ids beyond it (the preset's vocabulary is larger) decode to nothing.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

from mrl.errors import UserError
from mrl.models.config import ModelConfig
from mrl.models.facts import builtin_preset

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@lru_cache(maxsize=None)
def byte_tokenizer():
    """A byte-level `PreTrainedTokenizerFast` (259 ids) for the builtin presets."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: byte for byte, ch in bytes_to_unicode().items()}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0], pad_token=SPECIALS[0],
                                   additional_special_tokens=list(SPECIALS[1:]))
    fast.chat_template = CHATML
    return fast


def load_tokenizer(model: ModelConfig) -> Any:
    """`model.tokenizer`, else the checkpoint at `model.path`, else the byte tokenizer for presets."""
    source = model.tokenizer or model.path
    if builtin_preset(source) is not None:
        return byte_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=model.trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"model.tokenizer: cannot load a tokenizer from {source!r} ({str(e).splitlines()[0]})") from None
