"""The reward sources of a job, resolved from the `reward` section, and their static checks.

A job names one source (`reward.function`, `reward.builtin` or `reward.model_path`, weight 1) or a
list of weighted sources:

    [[reward.sources]]
    name = "correct"
    builtin = "math"
    weight = 1.0

    [[reward.sources]]
    name = "format"
    function = "jobs/rewards/format.py:score"
    weight = 0.1

The reward of a response is the weighted sum of its sources' scores. A source may also be a
reward service (`url = "http://..."`, called as `[reward.remote]` says) or the job's judge
(`judge = true`, the `[reward.judge]` table).
"""
from __future__ import annotations

import difflib
import numbers
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from mrl.errors import UserError
from mrl.reward import function as reward_function
from mrl.reward.builtins import builtin_ref
from mrl.reward.config import Builtin, RewardConfig
from mrl.reward.signature import VERL_PARAMS, Convention, Signature

BUILTINS = typing.get_args(Builtin)
KINDS = ("function", "builtin", "model_path", "url", "judge")
CODE_BUILTINS = ("code", "auto", "auto_mrl")   # builtins that receive the [reward.code] settings
SOURCE_KEYS = ("name", *KINDS, "weight", "score_key", "kwargs", "signature")
SIGNATURES = typing.get_args(Signature)


@dataclass(frozen=True)
class RewardSource:
    """One scorer: `kind` "function"/"builtin" runs `ref` in the worker pool; "model" is the reward
    model; "remote" posts to the service at `ref`; "judge" asks the job's judge model."""

    name: str
    kind: Literal["function", "builtin", "model", "remote", "judge"]
    ref: str  # module:function / file.py:function, the model path, the service URL, or "judge"
    weight: float = 1.0
    score_key: str = "score"
    kwargs: dict = field(default_factory=dict)
    convention: Convention = "mrl"  # how a function is called (`mrl.reward.signature`); builtins are mrl's
    verl_params: tuple[str, ...] = VERL_PARAMS  # the verl arguments passed by name (convention "verl")


def _single(cfg: RewardConfig) -> list[str]:
    """The single-source keys set in the `reward` section."""
    return [k for k in KINDS if getattr(cfg, k) is not None]


def _one_source(cfg: RewardConfig) -> dict | None:
    set_ = _single(cfg)
    if len(set_) != 1:
        return None
    kind = set_[0]
    value = True if kind == "judge" else getattr(cfg, kind)
    name = {"function": str(value).rpartition(":")[2], "builtin": value, "model_path": "model", "url": "remote",
            "judge": "judge"}[kind]
    return {"name": name, kind: value, **({"signature": cfg.signature} if kind == "function" else {})}


def reward_problems(cfg: RewardConfig, check_files: bool = True) -> list[tuple[str, str]]:
    """Every problem with the reward sources as (dotted key, one-line message); empty when fine.

    `check_files` also checks user function references statically (file exists, function defined,
    4 positional arguments) without running them.
    """
    problems: list[tuple[str, str]] = []
    single = _single(cfg)
    if cfg.sources and single and single != ["judge"]:   # [reward.judge] configures `judge = true` sources
        problems.append(("reward.sources", f"set either reward.sources or reward.{single[0]}, not both"))
    elif not cfg.sources and len(single) != 1:
        got = ", ".join(f"reward.{k}" for k in single) or "none"
        problems.append(("reward", f"set exactly one of reward.function, reward.builtin, reward.model_path (got {got}), "
                                   "reward.url or a [reward.judge] table"))
    if cfg.signature != "auto" and (cfg.sources or single != ["function"]):
        problems.append(("reward.signature", "applies to reward.function only"
                         + ("; set signature in the [[reward.sources]] table" if cfg.sources else "")))
    tables = cfg.sources or ([_one_source(cfg)] if len(single) == 1 else [])
    names: set[str] = set()
    models = 0
    for i, src in enumerate(tables):
        key = f"reward.sources[{i}]" if cfg.sources else "reward"
        for k in src:
            if k not in SOURCE_KEYS:
                close = difflib.get_close_matches(k, SOURCE_KEYS, n=1)
                problems.append((f"{key}.{k}", "unknown key" + (f"; did you mean `{close[0]}`?" if close else "")))
        name = src.get("name")
        if not isinstance(name, str) or not name:
            problems.append((f"{key}.name", "missing: each source needs a name (its metrics are reward/<name>/...)"))
        elif name in names:
            problems.append((f"{key}.name", f"{name!r} is used by another source"))
        names.add(name if isinstance(name, str) else "")
        kinds = [k for k in KINDS if k in src]
        if len(kinds) != 1:
            problems.append((key, f"set exactly one of {', '.join(KINDS)} (got {', '.join(kinds) or 'none'})"))
            continue
        kind, value = kinds[0], src[kinds[0]]
        if kind == "judge":
            if value is not True:
                problems.append((f"{key}.judge", "must be true (the judge is the [reward.judge] table)"))
            elif cfg.judge is None:
                problems.append((f"{key}.judge", "needs a [reward.judge] table (its url or model, template, pattern)"))
        elif kind == "url" and isinstance(value, str) and not value.startswith(("http://", "https://")):
            problems.append((f"{key}.url", f"{value!r} is not an http:// or https:// URL"))
        if kind == "judge":
            pass
        elif not isinstance(value, str):
            problems.append((f"{key}.{kind}", f"must be a string, got {type(value).__name__}"))
            continue
        if kind == "builtin" and value not in BUILTINS:
            close = difflib.get_close_matches(value, BUILTINS, n=1)
            problems.append((f"{key}.builtin", f"{value!r} is not a builtin reward ({', '.join(BUILTINS)})"
                             + (f"; did you mean {close[0]!r}?" if close else "")))
        signature = src.get("signature", "auto")
        if signature not in SIGNATURES:
            problems.append((f"{key}.signature", f"{signature!r} is not one of {', '.join(map(repr, SIGNATURES))}"))
        elif kind != "function" and "signature" in src:
            problems.append((f"{key}.signature", f"applies to a function, not a {kind}"))
        elif kind == "function" and check_files:
            kwargs = src.get("kwargs", cfg.kwargs if not cfg.sources else {})
            problem = reward_function.reward_call(value, signature, kwargs if isinstance(kwargs, dict) else {})[0]
            if problem:
                problems.append((f"{key}.function", problem))
        models += kind == "model_path"
        weight = src.get("weight", 1.0)
        if not isinstance(weight, numbers.Real) or isinstance(weight, bool):
            problems.append((f"{key}.weight", f"must be a number, got {type(weight).__name__}"))
        if not isinstance(src.get("score_key", ""), str):
            problems.append((f"{key}.score_key", "must be a string"))
        if not isinstance(src.get("kwargs", {}), dict):
            problems.append((f"{key}.kwargs", "must be a table"))
    if models > 1:
        problems.append(("reward.sources", f"{models} sources set model_path; one reward model per job is supported"))
    if cfg.judge is not None:
        problems.extend(_judge_problems(cfg.judge))
    runs_code = any(src.get("builtin") in CODE_BUILTINS for src in tables if isinstance(src, dict))
    if runs_code and cfg.timeout_s < cfg.code.test_timeout_s + 3.0:
        problems.append(("reward.timeout_s", f"{cfg.timeout_s:g} s leaves no room for one code test of "
                                             f"reward.code.test_timeout_s = {cfg.code.test_timeout_s:g} s (needs at least "
                                             f"{cfg.code.test_timeout_s + 3.0:g} s; a response's tests share it)"))
    return problems


def _judge_problems(judge) -> list[tuple[str, str]]:
    from mrl.reward.judge import judge_engine_problems, pattern_problem, template_problem

    problems = []
    if judge.url is None and judge.model is None:
        problems.append(("reward.judge", "set reward.judge.url (an OpenAI chat-completions endpoint) or "
                                         "reward.judge.model (a local Hugging Face model path)"))
    if judge.url is not None and not judge.url.startswith(("http://", "https://")):
        problems.append(("reward.judge.url", f"{judge.url!r} is not an http:// or https:// URL"))
    for key, problem in (("template", template_problem(judge.template)), ("pattern", pattern_problem(judge.pattern))):
        if problem:
            problems.append((f"reward.judge.{key}", problem))
    return problems + judge_engine_problems(judge)


def reward_sources(cfg: RewardConfig, check_files: bool = True) -> tuple[RewardSource, ...]:
    """The job's sources, in order. Raises `UserError` listing every problem (see `reward_problems`)."""
    problems = reward_problems(cfg, check_files=check_files)
    if problems:
        lines = [f"{key}: {msg}" for key, msg in problems]
        raise UserError(lines[0], problems=lines)
    tables = cfg.sources or (_one_source(cfg),)
    out = []
    for src in tables:
        kind = next(k for k in KINDS if k in src)
        kwargs = dict(src.get("kwargs", cfg.kwargs if not cfg.sources else {}))
        if kind == "builtin" and src[kind] in CODE_BUILTINS:
            kwargs.update(code_settings(cfg))
        ref = builtin_ref(src[kind]) if kind == "builtin" else "judge" if kind == "judge" else src[kind]
        call = reward_function.reward_call(ref, src.get("signature", "auto"), kwargs) if kind == "function" else None
        kind = {"model_path": "model", "url": "remote"}.get(kind, kind)
        out.append(RewardSource(name=src["name"], kind=kind, ref=ref,
                                weight=float(src.get("weight", 1.0)), score_key=src.get("score_key", cfg.score_key),
                                kwargs=kwargs, **({"convention": call[1], "verl_params": call[2]} if call else {})))
    return tuple(out)


def code_settings(cfg: RewardConfig) -> dict:
    """The keyword arguments of the `code` builtin (`mrl.reward.code.code`) from `[reward.code]`: the
    sandbox limits, and a time budget that keeps a call inside `reward.timeout_s`."""
    c = cfg.code
    return {"score": c.score, "isolation": c.isolation, "max_tests": c.max_tests, "budget_s": max(cfg.timeout_s - 2.0, 1.0),
            "wall_s": c.test_timeout_s, "cpu_s": c.cpu_s, "memory_mb": c.memory_mb, "max_output_bytes": c.max_output_bytes,
            "file_size_mb": c.file_size_mb, "scratch_mb": c.scratch_mb, "processes": c.processes, "python": c.python}


def auto_source_problems(cfg: RewardConfig, files: tuple[str, ...], source_key: str) -> list[tuple[str, str]]:
    """(key, message) for each data source in `files` (parquet files that exist here; only their
    `source_key` column is read) that a `builtin = "auto"` source of `cfg` cannot score because verl
    scores it with a scorer mrl lacks (a code-execution reward for code contests): one per source."""
    from pathlib import Path

    import pyarrow.parquet as pq

    from mrl.reward.verl_scores import unsupported_message

    if reward_problems(cfg, check_files=False):
        return []
    keys = [("reward.builtin" if not cfg.sources else f"reward.sources[{i}].builtin")
            for i, s in enumerate(reward_sources(cfg, check_files=False)) if s.ref == builtin_ref("auto")]
    if not keys:
        return []
    seen: dict[str, str] = {}
    for name in files:
        if not Path(name).is_file():
            continue
        try:
            column = pq.read_table(name, columns=[source_key]).column(0).to_pylist()
        except Exception:  # noqa: BLE001 - no such column or an unreadable file: the data loader reports it
            continue
        for source in dict.fromkeys(str(v) for v in column if v is not None):
            seen.setdefault(source, name)
    return [(keys[0], f"{unsupported_message(source)} (rows of {name})")
            for source, name in seen.items() if unsupported_message(source)]
