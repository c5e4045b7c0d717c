"""LLM-as-judge rewards: a prompt template, a model that answers, a parser from the answer to a score.

The `[reward.judge]` table names the template (a user message over `{prompt}`, `{response}` and
`{ground_truth}`, plus an optional system message), the model, and the parser (a regex whose first
group, else its whole match, is a number; score = number x `scale`). An answer the pattern does
not match, or whose match is not a number, is a reward error of kind "parse" (counted as
`reward/<name>/errors/parse`, scored by `reward.on_error`).

The model is either

- an HTTP endpoint speaking OpenAI's chat completions (`url = ".../v1/chat/completions"`, `model`
  sent as the model name): one request per response, `[reward.remote]` gives the concurrency,
  timeout and retries (vLLM's, SGLang's and most serving stacks' OpenAI server speak it), or
- a local Hugging Face model (`model = "path"` without `url`; or a `builtin:` preset, a seeded
  random model with the byte tokenizer, for tests): transformers on CPU in the scoring process,
  the chat template of its tokenizer, greedy (or sampled at `temperature`) decoding, batched.
  Meant for small judges and CPU runs; a large judge belongs on a server of its own (vLLM's
  OpenAI server, on its own GPUs), reached through `url`.

Each source's outcomes carry the raw number as `rating` (logged as `reward/<name>/rating`).
"""
from __future__ import annotations

import logging
import re
import string
from typing import Any, Sequence

from mrl.errors import UserError
from mrl.reward.pool import Outcome
from mrl.reward.remote import RequestError, call_json, run_batches

log = logging.getLogger(__name__)
FIELDS = ("prompt", "response", "ground_truth")


def template_problem(template: str) -> str | None:
    """Why `template` cannot be filled (a field other than FIELDS, bad braces), or None."""
    try:
        names = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        return f"is not a format string: {e} (write literal braces as {{{{ and }}}})"
    unknown = sorted({n for n in names if n not in FIELDS})
    if unknown:
        return f"names {', '.join('{' + n + '}' for n in unknown)}; a judge template may use {{prompt}}, {{response}}, {{ground_truth}}"
    return None


def pattern_problem(pattern: str) -> str | None:
    try:
        re.compile(pattern)
    except re.error as e:
        return f"is not a regular expression: {e}"
    return None


def _text(value: Any) -> str:
    if isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value):   # chat messages
        return "\n".join(str(m["content"]) for m in value)
    return "" if value is None else str(value)


def judge_messages(template: str, system: str | None, prompt: Any, response: str, ground_truth: Any) -> list[dict]:
    """The chat messages the judge sees for one response."""
    user = template.format(prompt=_text(prompt), response=response, ground_truth=_text(ground_truth))
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def parse_rating(answer: str, pattern: str, scale: float) -> Outcome:
    """The score the judge's `answer` gives, or a "parse" error naming the answer."""
    m = re.search(pattern, answer or "")
    if m is None:
        return Outcome(error="parse", message=f"judge answer does not match reward.judge.pattern: {answer[:120]!r}")
    text = m.group(1) if m.groups() else m.group(0)
    try:
        rating = float(text)
    except (TypeError, ValueError):
        return Outcome(error="parse", message=f"judge answer's match {text!r} is not a number: {answer[:120]!r}")
    return Outcome(value={"score": rating * scale, "rating": rating})


class HttpJudge:
    """The judge behind an OpenAI chat-completions endpoint."""

    def __init__(self, cfg, remote):
        from mrl.reward.remote import request_headers

        self.cfg, self.remote = cfg, remote
        self.headers = request_headers(remote)

    def _ask(self, batch: list) -> list[Outcome]:
        (messages,) = batch
        payload = {"model": self.cfg.model or "judge", "messages": messages, "max_tokens": self.cfg.max_tokens,
                   "temperature": self.cfg.temperature}
        answer = call_json(self.cfg.url, payload, timeout_s=self.remote.timeout_s, retries=self.remote.retries,
                           backoff_s=self.remote.backoff_s, headers=self.headers)
        try:
            content = answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise RequestError("bad_response", f"{self.cfg.url} answered without choices[0].message.content: "
                                               f"{str(answer)[:120]}") from None
        return [parse_rating(content or "", self.cfg.pattern, self.cfg.scale)]

    def __call__(self, conversations: list[list[dict]]) -> list[Outcome]:
        results = run_batches([[c] for c in conversations], self._ask, self.remote.concurrency)
        return [r[0] for r in results]


class LocalJudge:
    """The judge as a local transformers model (CPU or this rank's GPU), batched greedy decoding."""

    def __init__(self, cfg, batch_size: int = 8):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from mrl.models.facts import BUILTIN_PRESETS, builtin_preset

        self.cfg, self.batch_size, self.torch = cfg, batch_size, torch
        preset = builtin_preset(cfg.model)
        if preset is not None:   # a tiny random model (seeded) with the byte tokenizer: tests and CPU smoke runs
            from transformers import AutoConfig

            from mrl.models.tokenizer import byte_tokenizer

            if preset not in BUILTIN_PRESETS:
                raise UserError(f"reward.judge.model: unknown builtin preset {preset!r} ({', '.join(BUILTIN_PRESETS)})")
            kwargs = dict(BUILTIN_PRESETS[preset])
            torch.manual_seed(0)
            self.model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)).eval()
            self.tokenizer = byte_tokenizer()
        else:
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
                self.model = AutoModelForCausalLM.from_pretrained(cfg.model, torch_dtype=torch.float32).eval()
            except (OSError, ValueError) as e:
                raise UserError(f"reward.judge.model: cannot load {cfg.model!r}: {str(e).splitlines()[0]}") from None
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token

    def _prompt(self, messages: list[dict]) -> str:
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return "\n\n".join(m["content"] for m in messages) + "\n\n"

    def __call__(self, conversations: list[list[dict]]) -> list[Outcome]:
        out: list[Outcome] = []
        for i in range(0, len(conversations), self.batch_size):
            texts = [self._prompt(c) for c in conversations[i:i + self.batch_size]]
            enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            sample = self.cfg.temperature > 0
            with self.torch.no_grad():
                ids = self.model.generate(**enc, max_new_tokens=self.cfg.max_tokens, do_sample=sample,
                                          temperature=self.cfg.temperature if sample else None, top_p=None, top_k=None,
                                          pad_token_id=self.tokenizer.pad_token_id)
            answers = self.tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            out.extend(parse_rating(a, self.cfg.pattern, self.cfg.scale) for a in answers)
        return out


class JudgeScorer:
    """Scores samples with the job's judge; one `Outcome` per sample."""

    def __init__(self, cfg, remote):
        self.cfg = cfg
        self.model = HttpJudge(cfg, remote) if cfg.url else LocalJudge(cfg)
        self.remote = remote

    def __call__(self, samples: Sequence) -> list[Outcome]:
        conversations = [judge_messages(self.cfg.template, self.cfg.system, s.prompt, s.response, s.ground_truth)
                         for s in samples]
        return self.model(conversations)
