"""The `reward` section: how responses are scored.

Either one source (`reward.function`, `reward.builtin` or `reward.model_path`) or a weighted list
of them in `[[reward.sources]]`; `mrl.reward.sources.reward_problems` checks the combination.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

from mrl.config.schema import option, section

Builtin = Literal["exact_match", "gsm8k", "math", "reasoning_gym", "format_boxed", "format_answer_tags",
                  "format_think_answer", "auto", "auto_mrl", "verl_gsm8k", "verl_math", "verl_math_dapo",
                  "verl_prime_math", "verl_geo3k", "verl_search_r1_qa"]


@section
class RewardConfig:
    """A user function `file.py:function`, a builtin rule verifier, a reward model, or a weighted mix."""

    function: Optional[str] = option(None, help="'path/to/file.py:function' or 'module:function'; score(prompt, response, ground_truth, extra) or verl's compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict (see reward.signature)")
    builtin: Optional[Builtin] = option(None, help="builtin rule verifier. verl's scores (as verl 0.9.1): auto (verl's default_compute_score by each row's data source: openai/gsm8k, lighteval/MATH, MATH-500, math_dapo, aime*, numina_*, hiyouga/geometry3k, searchR1_*; reasoning_gym/<task> by the task), verl_gsm8k (strict '#### n' as text), verl_math (Hendrycks boxed), verl_math_dapo ('Answer:' line, +1/-1), verl_prime_math (numina_*), verl_geo3k (hiyouga/geometry3k), verl_search_r1_qa. mrl's forgiving ones: gsm8k (#### n as a number), math (math-verify, last boxed), auto_mrl (gsm8k / math / reasoning_gym by data source), exact_match, reasoning_gym, format_boxed, format_answer_tags, format_think_answer")
    model_path: Optional[str] = option(None, help="reward model checkpoint (scalar head)")
    sources: tuple[dict[str, Any], ...] = option((), help="weighted mix instead of one source: [[reward.sources]] tables with name, one of function/builtin/model_path, weight (default 1), score_key, kwargs")
    signature: Literal["auto", "mrl", "verl"] = option("auto", help="how reward.function is called: mrl's score(prompt, response, ground_truth, extra), verl's compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs) by name, or auto (verl's when a parameter is named data_source, solution_str or extra_info); per source: signature in [[reward.sources]]")
    score_key: str = option("score", help="key of the score when the function returns a dict")
    kwargs: dict[str, Any] = option(factory=dict, help="extra keyword arguments passed to the function")
    workers: int = option(4, ge=1, help="reward processes (functions run isolated, in a pool)")
    timeout_s: float = option(30.0, gt=0, help="a call that takes longer is killed and scored on_error")
    memory_mb: int = option(4096, ge=0, help="address space per reward process in MiB (RLIMIT_AS); a call past it fails as 'memory'; 0 = no limit")
    max_output_bytes: int = option(4096, ge=0, help="stdout/stderr a reward call may print; the rest is dropped and counted (reward/output_truncated_calls)")
    env_allow: tuple[str, ...] = option((), help="environment variables reward workers may see besides the default allowlist (names or shell patterns, e.g. ['OPENAI_API_KEY', 'MY_*']); tokens, keys, secrets and tracking credentials are hidden otherwise")
    on_error: Literal["zero", "drop", "fail"] = option("zero", help="a call that raises, hangs, crashes or returns NaN or a non-number is counted and scores 0 (zero), is left out of the update (drop), or fails the step (fail)")
    micro_batch_tokens: Optional[int] = option(None, ge=1, help="reward model token budget per forward")
