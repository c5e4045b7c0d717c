"""`mrl generate`: responses of a checkpoint's policy (through the job's rollout engine) to prompts
given on the command line or in a JSONL file, as JSONL rows.

A prompts file has one prompt per line: a JSON string, or an object whose `prompt` is a string
or a list of chat messages. Prompts are rendered with the job's chat settings
(`data.chat_template`, `data.system_prompt`), as training renders its data. Sampling is what
the policy samples in training (`rollout.temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty`, `max_response_tokens`), one response per prompt; `-n`, `--temperature`
(0: greedy) and `--max-tokens` override it.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterator, Optional

from mrl.errors import UserError
from mrl.offline.target import Target


@dataclasses.dataclass(frozen=True)
class SamplingOverrides:
    """The command line's changes to the job's validation sampling (None: the job's)."""

    n: Optional[int] = None
    temperature: Optional[float] = None
    max_tokens: Optional[int] = None


def read_prompts(path: str | Path) -> list[Any]:
    """The prompts of a JSONL file (see the module docstring), one-line errors naming the line."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"generate: --prompts {path}: no such file")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
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
        prompts.append(prompt)
    if not prompts:
        raise UserError(f"generate: --prompts {path}: no prompts in the file")
    return prompts


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


def generate_rows(target: Target, prompts: list[Any], overrides: SamplingOverrides) -> Iterator[dict]:
    """One row per response: the prompt, its index, the sample's index, the response text, its
    token count and finish reason, and the policy step that generated it."""
    from mrl.data.template import encode_prompt, render_prompt
    from mrl.offline.session import session
    from mrl.train.rollout import generate

    sampling = sampling_of(target.spec, overrides)
    with session(target) as (run, gen, _):
        data, tok = run.spec.data, run.tokenizer
        ids = [encode_prompt(render_prompt(p, tok, chat_template=data.chat_template, system_prompt=data.system_prompt,
                                           origin=f"prompt {i}"), tok, chat_template=data.chat_template)
               for i, p in enumerate(prompts)]
        responses = generate(run, gen, ids, sampling)
    for k, r in enumerate(responses):
        i = k // sampling.n
        yield {"index": i, "sample": k % sampling.n, "prompt": prompts[i],
               "response": tok.decode(r.token_ids, skip_special_tokens=True), "response_tokens": len(r.token_ids),
               "finish_reason": r.finish_reason, "step": target.step}
