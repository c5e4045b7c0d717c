"""A teacher tokenizer unlike the student's byte tokenizer (`mrl.models.tokenizer.byte_tokenizer`):
the same 256 bytes, its own special tokens (`</s>` ends a sequence) and byte-pair merges, so the
student's text comes out in fewer, longer tokens with other ids."""
from __future__ import annotations

MERGES = (("1", "2"), ("12", "3"), ("4", "5"), ("a", "b"), ("Ġ", "="))   # (Ġ: the space byte)


def merged_tokenizer(merges=MERGES):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: byte for byte, ch in bytes_to_unicode().items()}
    for s in ("</s>", "<|im_start|>", "<|im_end|>"):
        vocab[s] = len(vocab)
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="</s>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
