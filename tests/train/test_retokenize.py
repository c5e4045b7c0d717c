"""A teacher with another tokenizer (`mrl.train.retokenize`): the student's response in the
teacher's tokens, chunked where both tokenizations end at one character, and the teacher's
log-probs shared back over each chunk's student tokens (hand-checked)."""
from __future__ import annotations

import pytest
import torch

from mrl.models.tokenizer import byte_tokenizer
from mrl.train.retokenize import align, attribute, token_ends
from tests.train.merged_tokenizer import merged_tokenizer


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_chunks_end_where_both_tokenizations_end():
    s, t = byte_tokenizer(), merged_tokenizer()
    a = align(s, t, _ids(s, "<|im_start|>q"), _ids(s, "12345x") + [s.eos_token_id])
    assert t.convert_ids_to_tokens(a.prompt) == ["<|im_start|>", "q"]   # the student's prompt text, re-encoded
    assert t.convert_ids_to_tokens(a.response) == ["123", "45", "x", "</s>"]   # <|endoftext|> -> the teacher's eos
    assert a.student_chunk == [0, 0, 0, 1, 1, 2, 3] and a.teacher_chunk == [0, 1, 2, 3]
    # "1" + "2" | "ab": the chunk boundary is where both end; no final special token, no eos
    b = align(s, t, [], _ids(s, "x12ab"))
    assert t.convert_ids_to_tokens(b.response) == ["x", "12", "ab"]
    assert b.student_chunk == [0, 1, 1, 2, 2] and b.teacher_chunk == [0, 1, 2]


def test_a_character_split_over_tokens_stays_in_one_chunk():
    s, t = byte_tokenizer(), merged_tokenizer(merges=(("Ã", "©"),))   # é = bytes c3 a9, one teacher token
    ids = _ids(s, "xé1")
    assert token_ends(s, ids) == ("xé1", [1, None, 2, 3])   # the first byte of é ends inside the character
    a = align(s, t, [], ids)
    assert a.response == _ids(t, "xé1") and len(a.response) == 3
    assert a.student_chunk == [0, 1, 1, 2] and a.teacher_chunk == [0, 1, 2]


def test_attribution_shares_each_chunks_log_ratio():
    s, t = byte_tokenizer(), merged_tokenizer()
    a = align(s, t, [], _ids(s, "12345x") + [s.eos_token_id])   # chunks: 123 | 45 | x | eos
    lp = torch.tensor([-1.0, -2.0, -3.0, -0.5, -0.25, -4.0, -0.1])
    lq = torch.tensor([-3.0, -1.5, -2.0, -0.3])
    got = attribute(lp, lq, a)
    # chunk 0: (-3 - (-6)) / 3 = +1 each; chunk 1: (-1.5 - (-0.75)) / 2 = -0.375 each; then one to one
    want = torch.tensor([0.0, -1.0, -2.0, -0.875, -0.625, -2.0, -0.3])
    assert torch.allclose(got, want, atol=1e-12, rtol=0)
    assert abs((got - lp).sum().item() - (lq.sum() - lp.sum()).item()) < 1e-12   # sums to the sequence's log-ratio


def test_the_same_tokenizer_aligns_token_for_token():
    s = byte_tokenizer()
    ids = _ids(s, "a=1 é?") + [s.eos_token_id]
    a = align(s, s, _ids(s, "<|im_start|>hi"), ids)
    assert a.response == ids and a.prompt == _ids(s, "<|im_start|>hi")
    # é's two bytes: one chunk of two student and two teacher tokens; every other chunk one to one
    assert a.student_chunk == a.teacher_chunk == [0, 1, 2, 3, 4, 4, 5, 6]
    lp, lq = -torch.rand(len(ids), dtype=torch.float64), -torch.rand(len(ids), dtype=torch.float64)
    got = attribute(lp, lq, a)
    keep = [0, 1, 2, 3, 6, 7]
    assert torch.equal(got[keep], lq[keep]) and abs((got[4:6].sum() - lq[4:6].sum()).item()) < 1e-12


def test_tokens_with_no_text_take_no_signal():
    s, t = byte_tokenizer(), merged_tokenizer()
    a = align(s, t, [], [s.eos_token_id])   # an empty response: just the end of sequence
    assert t.convert_ids_to_tokens(a.response) == ["</s>"] and a.student_chunk == a.teacher_chunk == [0]
    lp = torch.tensor([-0.7])
    assert attribute(lp, torch.tensor([-0.2]), a).tolist() == pytest.approx([-0.2])
