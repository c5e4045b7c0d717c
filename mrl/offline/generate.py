"""`mrl generate`: responses of a checkpoint's policy (through the job's rollout engine) to prompts
given on the command line, in a JSONL file, or taken from the job's own data, as JSONL or
parquet rows, scored with the job's reward where the prompts carry answers.

A prompts file has one prompt per line: a JSON string, or an object whose `prompt` is a string
or a list of chat messages (and, to be scored, its `answer`, optionally its `data_source`). For a
vision-language model, `images` lists the image files of the prompt's `<image>` marks (relative
paths are beside the prompts file); they are processed as training processes its data's images.
`--from-data N` takes the first N prompts of the job's data (`data.val_files`, or the
generator's validation prompts, else the training data), with their answers. Prompts are
rendered with the job's chat settings (`data.chat_template`, `data.system_prompt`), as training
renders its data. Sampling is what the policy samples in training (`rollout.temperature`,
`top_p`, `top_k`, `min_p`, `repetition_penalty`, `max_response_tokens`), one response per
prompt; `-n`, `--temperature` (0: greedy) and `--max-tokens` override it. Scores are the job's
reward (`reward.*`, a reward model included) as training computes them: the `score` column.

Inputs are checked before any work: a prompts file that is not UTF-8 text, or a prompt of more
bytes than the model could take (`prompt_byte_limit`), is one line naming it; `--out` goes
through `mrl.outputs.check_output`.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

from mrl.data.prompts import BYTES_PER_TOKEN, prompt_byte_limit, prompt_bytes
from mrl.errors import UserError
from mrl.offline.target import Target


@dataclasses.dataclass(frozen=True)
class SamplingOverrides:
    """The command line's changes to the job's validation sampling (None: the job's)."""

    n: Optional[int] = None
    temperature: Optional[float] = None
    max_tokens: Optional[int] = None


DATA_PROMPTS = 16   # prompts `--from-data` takes when it names no count (and when no prompt is given)


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt to answer; `answer` (None: unknown) and `data_source` are what the reward reads."""

    prompt: Any
    answer: Any = None
    data_source: str = ""
    images: tuple = ()   # image files (paths) for the prompt's `<image>` marks, in order (VLMs)


@dataclasses.dataclass(frozen=True)
class FromData:
    """The first `count` prompts of the job's data, split `split` ("train" or "val")."""

    count: int
    split: str


def read_requests(path: str | Path) -> list[Request]:
    """The prompts of a JSONL file (see the module docstring), one-line errors naming the line."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"generate: --prompts {path}: no such file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise UserError(f"generate: --prompts {path}:{line}: not UTF-8 text (byte {e.start} is {data[e.start]:#04x}); "
                        "a prompts file is JSONL") from None
    if "\x00" in text:
        raise UserError(f"generate: --prompts {path}:{text.count(chr(10), 0, text.index(chr(0))) + 1}: a NUL byte; "
                        "a prompts file is JSONL text, not a binary file")
    requests = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise UserError(f"generate: {path}:{number}: not JSON ({e})") from None
        prompt = row.get("prompt") if isinstance(row, dict) else row
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt))):
            raise UserError(f"generate: {path}:{number}: expected a string or an object with a \"prompt\" "
                            "(a string or a list of chat messages)")
        extra = row if isinstance(row, dict) else {}
        images = extra.get("images") or []
        if isinstance(images, str):
            images = [images]
        if not (isinstance(images, list) and all(isinstance(p, str) for p in images)):
            raise UserError(f"generate: {path}:{number}: \"images\" is a list of image file paths")
        images = tuple(p if Path(p).is_absolute() else str(path.parent / p) for p in images)   # beside the file
        requests.append(Request(prompt, extra.get("answer"), str(extra.get("data_source") or ""), images))
    if not requests:
        raise UserError(f"generate: --prompts {path}: no prompts in the file")
    return requests


def read_prompts(path: str | Path) -> list[Any]:
    """The prompts alone of a JSONL prompts file."""
    return [r.prompt for r in read_requests(path)]


def from_data(spec, count: Optional[int], split: Optional[str]) -> FromData:
    """`--from-data [N] [--split S]` resolved: N prompts (default `DATA_PROMPTS`) of the split, by
    default the held-out one when the job has one (val files, or a generator's validation
    prompts), else the training data."""
    if count is not None and count < 1:
        raise UserError(f"generate: --from-data {count}: must be >= 1")
    data = spec.data
    if split is None:
        split = "val" if data.val_files or data.generator else "train"
    if split == "val" and not (data.val_files or data.generator):
        raise UserError("generate: --split val: the job has no validation data (data.val_files); use --split train")
    return FromData(count=count or DATA_PROMPTS, split=split)


def sampling_of(spec, overrides: SamplingOverrides):
    """The job's training `Sampling`, one response per prompt, with the command line's overrides."""
    from mrl.rollout.types import sampling_from_config

    sampling = dataclasses.replace(sampling_from_config(spec.rollout, seed=spec.job.seed), n=1)
    changes = {k: v for k, v in dataclasses.asdict(overrides).items() if v is not None}
    if "n" in changes and changes["n"] < 1:
        raise UserError(f"generate: -n {changes['n']}: must be >= 1")
    if "max_tokens" in changes and changes["max_tokens"] < 1:
        raise UserError(f"generate: --max-tokens {changes['max_tokens']}: must be >= 1")
    if "temperature" in changes and changes["temperature"] < 0:
        raise UserError(f"generate: --temperature {changes['temperature']}: must be >= 0")
    return dataclasses.replace(sampling, **changes)


def generate_rows(target: Target, prompts: list[Request] | FromData, overrides: SamplingOverrides, *,
                  scored: bool = True) -> list[dict]:
    """One row per response: the prompt, its index, the sample's index, the response text, its
    token count and finish reason, the policy step that generated it and, when every prompt has
    an answer (the job's data always does) and `scored`, its answer and the job's reward (`score`)."""
    from mrl.offline.session import session
    from mrl.train.rollout import generate
    from mrl.train.scoring import score

    sampling = sampling_of(target.spec, overrides)
    if not isinstance(prompts, FromData):
        check_prompt_sizes(target.spec, prompts)   # before the model loads
    with session(target) as (run, gen, reward_model):
        tok = run.tokenizer
        items = _items(run, prompts)
        scored = scored and all(it.answer is not None for it in items)
        responses = generate(run, gen, [list(it.token_ids) for it in items], sampling,
                             images=[getattr(it, "images", None) for it in items])
        scores = score(run, gen, items, responses, sampling.n, target.step,
                       reward_model=reward_model)["scores"] if scored else None
    rows = []
    for k, r in enumerate(responses):
        it = items[k // sampling.n]
        row = {"index": it.index, "sample": k % sampling.n, "prompt": it.prompt,
               "response": tok.decode(r.token_ids, skip_special_tokens=True), "response_tokens": len(r.token_ids),
               "finish_reason": r.finish_reason, "step": target.step}
        if scores is not None:
            row.update(answer=it.answer, data_source=it.data_source, score=float(scores[k]))
        rows.append(row)
    return rows


def _items(run, prompts: list[Request] | FromData) -> list:
    """`PromptItem`s (`mrl.data.prompts`) of the requests, rendered and tokenized as training
    renders its data; or the first prompts of the job's data split."""
    from mrl.data.prompts import PromptItem
    from mrl.data.source import load_prompts
    from mrl.data.template import encode_prompt, render_prompt

    if isinstance(prompts, FromData):
        dataset = load_prompts(run.spec.data, run.tokenizer, prompts.split, images=run.images)
        return dataset.items[:prompts.count]
    data, tok = run.spec.data, run.tokenizer
    _refuse_oversized(prompts, prompt_byte_limit(data.max_prompt_tokens, tok))
    if run.images is not None:   # a vision-language model: its images processed as training processes its data
        return _image_items(run, prompts)
    if any(req.images for req in prompts):
        raise UserError(f"generate: prompt {next(i for i, r in enumerate(prompts) if r.images)} has images, but "
                        f"{run.spec.model.path} is not a vision-language model")
    items = []
    for i, req in enumerate(prompts):
        text = render_prompt(req.prompt, tok, chat_template=data.chat_template, system_prompt=data.system_prompt,
                             origin=f"prompt {i}")
        items.append(PromptItem(index=i, token_ids=tuple(encode_prompt(text, tok, chat_template=data.chat_template)),
                                text=text, prompt=req.prompt, answer=req.answer, data_source=req.data_source,
                                origin=f"prompt {i}"))
    return items


def _image_items(run, prompts: list[Request]) -> list:
    """The requests of a vision-language model as `PromptItem`s with their images: rendered,
    expanded and tokenized by the training data's own path (`mrl.data.prompts.tokenize_rows`); a
    bad image, marks that do not pair with the images, or a prompt over `data.max_prompt_tokens`
    is one line naming the prompt."""
    from mrl.data.images import IMAGE_COLUMN
    from mrl.data.prompts import tokenize_rows
    from mrl.data.rows import PromptRow

    data = run.spec.data
    rows = [PromptRow(req.prompt, req.answer, req.data_source, f"prompt {i}",
                      extra={IMAGE_COLUMN: list(req.images)} if req.images else {})
            for i, req in enumerate(prompts)]
    dataset = tokenize_rows(rows, run.tokenizer, max_prompt_tokens=data.max_prompt_tokens, overflow="error",
                            chat_template=data.chat_template, system_prompt=data.system_prompt,
                            special_tokens_in_text=data.special_tokens_in_text, images=run.images, bad_rows="error")
    return dataset.items


def _refuse_oversized(prompts: list[Request], limit: int) -> None:
    for i, req in enumerate(prompts):
        size = prompt_bytes(req.prompt)
        if size > limit:
            head = (req.prompt if isinstance(req.prompt, str) else str(req.prompt))[:40]
            raise UserError(f"generate: prompt {i} ({head!r}...) has {size} bytes, more than {limit} = "
                            f"{limit // BYTES_PER_TOKEN} tokens (the model's max length, or data.max_prompt_tokens) x "
                            f"{BYTES_PER_TOKEN} bytes; it is not tokenized")


def check_prompt_sizes(spec, prompts: list[Request]) -> None:
    """`_refuse_oversized` before any model is loaded: prompts within `data.max_prompt_tokens` x
    `BYTES_PER_TOKEN` pass at once; a longer one is measured against the tokenizer's stated
    length too (the tokenizer alone is loaded for it)."""
    if all(prompt_bytes(r.prompt) <= spec.data.max_prompt_tokens * BYTES_PER_TOKEN for r in prompts):
        return
    from mrl.models.tokenizer import load_tokenizer

    _refuse_oversized(prompts, prompt_byte_limit(spec.data.max_prompt_tokens, load_tokenizer(spec.model)))


def write_rows(rows: list[dict], path: str | Path) -> None:
    """`rows` as JSONL, or as parquet when `path` ends in `.parquet` (a column whose values have no
    single Arrow type, such as prompts that are sometimes text and sometimes chat messages, is
    stored as JSON text)."""
    path = Path(path)
    if path.suffix != ".parquet":
        path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {}
    for key in dict.fromkeys(k for row in rows for k in row):
        values = [row.get(key) for row in rows]
        try:
            columns[key] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
            columns[key] = pa.array([v if isinstance(v, str) or v is None else json.dumps(v, ensure_ascii=False)
                                     for v in values], type=pa.string())
    pq.write_table(pa.table(columns), path)
