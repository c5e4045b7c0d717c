"""A teacher with another tokenizer (`[distill]`, `distill.estimator = "sampled"`): the student's
response as the teacher's tokens, and the teacher's log-probs attributed back to the student's.

The student's response ids are decoded to text; the teacher's tokenizer encodes that text; the
two tokenizations are aligned by character offsets into chunks, the shortest runs of tokens that
cover the same characters on both sides (a chunk ends where a student token and a teacher token
both end). Each chunk's teacher log-prob (the sum over its teacher tokens) is then shared by its
student tokens: `lq_k = lp_k + (LQ_c - LP_c) / n_c` for the `n_c` student tokens `k` of chunk
`c`, `LQ_c` and `LP_c` the chunk's teacher and student log-prob sums. So the per-token estimate
`lq_k - lp_k` of the distillation advantage sums, over a chunk, to the chunk's log-ratio, and
where the tokenizations agree (one token each side) `lq_k` is exactly the teacher's log-prob of
that token. docs/algorithms.md writes out the estimator and its approximations.

Pure functions of token ids and tokenizers (Hugging Face `PreTrainedTokenizerFast`: the teacher's
side needs `return_offsets_mapping`).
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Optional, Sequence

import torch

__all__ = ["Aligned", "token_ends", "align", "attribute"]

_WINDOW = 6   # tokens of left context when decoding one token (SentencePiece spaces, multi-byte characters)


@dataclasses.dataclass(frozen=True)
class Aligned:
    """One response in the teacher's tokens: `prompt` and `response` (teacher ids), and for each
    student response token and each teacher response token, the index of its chunk."""
    prompt: list[int]
    response: list[int]
    student_chunk: list[int]
    teacher_chunk: list[int]


def _decode(tok, ids: Sequence[int]) -> str:
    return tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def token_ends(tok, ids: Sequence[int]) -> tuple[str, list[Optional[int]]]:
    """(the text of `ids`, each token's end offset in it): None where a token ends inside a
    character (a multi-byte character split over tokens) or its end is otherwise unsettled;
    such a token shares the end of the next settled one. Decoded a few tokens at a time (each
    token with `_WINDOW` tokens of left context), checked against the decode of all of `ids`."""
    ends: list[Optional[int]] = [None] * len(ids)
    text, start = "", 0          # start: the first token whose end is not settled yet
    for k in range(len(ids)):
        lo = max(0, start - _WINDOW)
        before, after = _decode(tok, ids[lo:start]), _decode(tok, ids[lo:k + 1])
        if after.endswith("\ufffd") or not after.startswith(before):
            continue
        text += after[len(before):]
        ends[k], start = len(text), k + 1
    full = _decode(tok, ids)
    if not full.startswith(text):   # a tokenizer whose windowed decode differs: every prefix whole
        ends = [None] * len(ids)
        for k in range(len(ids)):
            prefix = _decode(tok, ids[:k + 1])
            if full.startswith(prefix) and not prefix.endswith("\ufffd"):
                ends[k] = len(prefix)
    return full, ends


def _final_special(student, ids: Sequence[int]) -> Optional[int]:
    return ids[-1] if ids and ids[-1] in set(student.all_special_ids) else None


def align(student, teacher, prompt: Sequence[int], response: Sequence[int]) -> Aligned:
    """`prompt` and `response` (the student's ids) in the teacher's tokens, chunked.

    The prompt is the decoded text of the student's prompt (its chat template included)
    encoded by the teacher's tokenizer without added special tokens. A final special token of
    the response (the student's end of sequence) becomes the teacher's token of the same string,
    else the teacher's `eos_token`, as a chunk of its own; the rest is decoded and re-encoded."""
    t_prompt = teacher(_decode(student, prompt), add_special_tokens=False)["input_ids"]
    stop = _final_special(student, response)
    body = list(response[:-1]) if stop is not None else list(response)
    text, s_ends = token_ends(student, body)
    enc = teacher(text, add_special_tokens=False, return_offsets_mapping=True)
    t_ids, spans = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    # a chunk ends where a settled student end meets a teacher end no later teacher token starts before
    s_clean = {e for e in s_ends if e is not None and e > 0}
    t_clean = {spans[j][1] for j in range(len(spans)) if spans[j][1] > 0 and (j + 1 == len(spans)
                                                                             or spans[j + 1][0] >= spans[j][1])}
    cuts = sorted((s_clean & t_clean) | ({len(text)} if text else set()))
    pos, later = [0] * len(body), len(text)
    for k in range(len(body) - 1, -1, -1):   # an unsettled end takes the next settled one
        later = s_ends[k] if s_ends[k] is not None else later
        pos[k] = later
    s_chunk = [min(bisect.bisect_left(cuts, p), max(len(cuts) - 1, 0)) for p in pos]
    t_chunk = [min(bisect.bisect_left(cuts, e), max(len(cuts) - 1, 0)) for _, e in spans]
    if stop is not None:
        name, vocab = student.convert_ids_to_tokens(stop), teacher.get_vocab()
        t_ids.append(vocab[name] if name in vocab else teacher.eos_token_id)
        last = max(len(cuts), 1) if body else 0
        s_chunk.append(last)
        t_chunk.append(last)
    return Aligned(prompt=list(t_prompt), response=t_ids, student_chunk=s_chunk, teacher_chunk=t_chunk)


def attribute(student_lp: torch.Tensor, teacher_lp: torch.Tensor, aligned: Aligned) -> torch.Tensor:
    """`[n]` the teacher's log-prob attributed to each of the `n` student tokens of one response:
    `lp_k + (LQ_c - LP_c) / n_c` over the chunk `c` of token `k` (`student_lp [n]` the student's
    log-probs, `teacher_lp [m]` the teacher's of its own tokens). A chunk with no teacher token
    (student tokens that decode to no text) gets no signal: `lq_k = lp_k`."""
    s_chunk = torch.as_tensor(aligned.student_chunk, dtype=torch.long)
    t_chunk = torch.as_tensor(aligned.teacher_chunk, dtype=torch.long)
    chunks = int(max(s_chunk.max().item() if len(s_chunk) else -1, t_chunk.max().item() if len(t_chunk) else -1)) + 1
    lp = student_lp.double()
    lq_sum = torch.zeros(chunks, dtype=torch.float64).index_add_(0, t_chunk, teacher_lp.double())
    lp_sum = torch.zeros(chunks, dtype=torch.float64).index_add_(0, s_chunk, lp)
    count = torch.zeros(chunks, dtype=torch.float64).index_add_(0, s_chunk, torch.ones_like(lp))
    has_teacher = torch.zeros(chunks, dtype=torch.bool).index_fill_(0, t_chunk, True) if len(t_chunk) else \
        torch.zeros(chunks, dtype=torch.bool)
    share = torch.where(has_teacher, (lq_sum - lp_sum) / count.clamp(min=1), torch.zeros_like(lq_sum))
    return (lp + share[s_chunk]).to(student_lp.dtype)
