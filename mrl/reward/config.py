"""The `reward` section: how responses are scored.

Either one source (`reward.function`, `reward.builtin`, `reward.model_path`, `reward.url` or
`reward.judge`) or a weighted list of them in `[[reward.sources]]`;
`mrl.reward.sources.reward_problems` checks the combination. `[reward.code]` sets the sandbox of
the code-execution builtin, `[reward.remote]` how reward services are called, `[reward.judge]`
the judge model (see docs/rewards.md).
"""
from __future__ import annotations

from typing import Any, Literal, Optional

from mrl.schema.section import option, section

Builtin = Literal["exact_match", "gsm8k", "math", "reasoning_gym", "format_boxed", "format_answer_tags",
                  "format_think_answer", "auto", "auto_mrl", "verl_gsm8k", "verl_math", "verl_math_dapo",
                  "verl_prime_math", "verl_geo3k", "verl_search_r1_qa", "code"]


@section
class CodeRewardConfig:
    """The `code` builtin: each test of a response's program runs in its own sandboxed process."""

    score: Literal["pass_rate", "all_pass"] = option("pass_rate", help="pass_rate: passed / tests; all_pass: 1 when every test passes (stops at the first failure)")
    isolation: Literal["auto", "namespaces", "rlimits"] = option("auto", help="auto / namespaces: network, mount and PID namespaces (a fresh root without the run, data or host sockets, a capped scratch tmpfs) and a fresh uid; the job does not start where that cannot be had. rlimits: limits and a scratch directory only, UNSAFE for untrusted code (docs/security.md)")
    test_timeout_s: float = option(5.0, gt=0, help="wall time per test; the process group is killed past it")
    cpu_s: int = option(4, ge=1, help="CPU seconds per test (RLIMIT_CPU)")
    memory_mb: int = option(512, ge=16, help="address space per test in MiB (RLIMIT_AS)")
    max_output_bytes: int = option(1 << 20, ge=1, help="stdout a test may print; more kills it (output_limit)")
    file_size_mb: int = option(16, ge=0, help="largest file a test may write (RLIMIT_FSIZE)")
    scratch_mb: int = option(64, ge=1, help="size of the tmpfs scratch directory (namespace modes)")
    processes: int = option(32, ge=1, help="processes the program may run (RLIMIT_NPROC, for its own uid)")
    max_tests: int = option(0, ge=0, help="run the first N tests of a row; 0 = all")
    python: str = option("auto", help="interpreter for the programs; auto: the trainer's when the sandbox uid can run it, else /usr/bin/python3")


@section
class RemoteRewardConfig:
    """How `url` sources (reward services) are called: batched JSON POSTs (docs/rewards.md)."""

    batch_size: int = option(16, ge=1, help="responses per request")
    concurrency: int = option(8, ge=1, help="requests in flight at once")
    timeout_s: float = option(30.0, gt=0, help="per request (connect + response)")
    retries: int = option(2, ge=0, help="retries of a failed request (connection error, timeout, HTTP 429/5xx)")
    backoff_s: float = option(0.5, ge=0, help="first retry's wait; doubles per retry")
    headers: dict[str, str] = option(factory=dict, help="extra HTTP headers (recorded with the run's spec: put secrets in header_env)")
    header_env: dict[str, str] = option(factory=dict, help="headers whose values come from environment variables at start, e.g. {Authorization = \"REWARD_AUTH\"}; never recorded")


@section
class JudgeConfig:
    """An LLM judge: a prompt template, a model that answers, a parser from the answer to a score."""

    url: Optional[str] = option(None, help="OpenAI chat-completions endpoint (.../v1/chat/completions), or none for a local HF model")
    model: Optional[str] = option(None, help="model name sent to the endpoint, or the HF model path of a local judge")
    template: str = option("Question:\n{prompt}\n\nReference answer:\n{ground_truth}\n\nResponse:\n{response}\n\nRate the response from 0 to 10. Reply with the number only.", help="user message; {prompt}, {response}, {ground_truth} are filled in")
    system: Optional[str] = option(None, help="system message")
    pattern: str = option(r"(-?\d+(?:\.\d+)?)", help="regex; its first group (else the match) is the score; no match is a reward error (parse)")
    scale: float = option(0.1, help="score = number x scale (0.1 maps a 0-10 rating to 0-1)")
    max_tokens: int = option(16, ge=1, help="tokens the judge may answer")
    temperature: float = option(0.0, ge=0, help="sampling temperature of the judge")
    engine: Literal["hf", "vllm"] = option("hf", help="engine of a local judge (model without url), built by mrl's rollout engine factory on every scoring rank: hf (transformers, anywhere) or vllm (its own engine processes, beside the trainer's world)")
    dtype: Optional[Literal["bfloat16", "float16", "float32"]] = option(None, help="local judge's dtype (default: bfloat16 on GPU, float32 on CPU)")
    tensor_parallel: int = option(1, ge=1, help="vllm judge: GPUs of one judge engine (this rank's and the next ones of its node)")
    gpu_memory_utilization: float = option(0.2, gt=0, le=1, help="vllm judge: fraction of GPU memory its engine may use (with a colocated vllm rollout engine the two must fit together); on CPU, the cap of its KV cache in host memory")
    max_model_len: Optional[int] = option(None, ge=1, help="longest judge prompt + answer in tokens (default: the judge model's max_position_embeddings); longer prompts are reward errors (too_long)")
    max_num_seqs: int = option(64, ge=1, help="judge prompts decoded together (hf: one batch; vllm: sequences scheduled at once)")
    sleep: bool = option(True, help="free the local judge's GPU memory between scoring calls (weights to host memory, KV cache dropped) so it holds none while the trainer trains; nothing is freed on CPU")
    engine_kwargs: dict[str, Any] = option(factory=dict, help="vllm judge: extra vllm.LLM arguments passed through verbatim (e.g. {enforce_eager = true})")


@section
class RewardConfig:
    """A user function `file.py:function`, a builtin rule verifier, a reward model, or a weighted mix."""

    function: Optional[str] = option(None, help="'path/to/file.py:function' or 'module:function'; score(prompt, response, ground_truth, extra) or verl's compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict (see reward.signature)")
    builtin: Optional[Builtin] = option(None, help="builtin rule verifier. verl's scores (as verl 0.9.1): auto (verl's default_compute_score by each row's data source: openai/gsm8k, lighteval/MATH, MATH-500, math_dapo, aime*, numina_*, hiyouga/geometry3k, searchR1_*, codecontests/apps/codeforces/taco (the code builtin); reasoning_gym/<task> by the task), verl_gsm8k (strict '#### n' as text), verl_math (Hendrycks boxed), verl_math_dapo ('Answer:' line, +1/-1), verl_prime_math (numina_*), verl_geo3k (hiyouga/geometry3k), verl_search_r1_qa. mrl's forgiving ones: gsm8k (#### n as a number), math (math-verify, last boxed), auto_mrl (gsm8k / math / reasoning_gym by data source), exact_match, reasoning_gym, format_boxed, format_answer_tags, format_think_answer; code: run the response's program against the row's tests in a sandbox ([reward.code], docs/rewards.md)")
    model_path: Optional[str] = option(None, help="reward model checkpoint (scalar head)")
    url: Optional[str] = option(None, help="reward service: POST batches of responses as JSON, read scores back ([reward.remote], docs/rewards.md)")
    code: CodeRewardConfig = option(factory=CodeRewardConfig)
    remote: RemoteRewardConfig = option(factory=RemoteRewardConfig)
    judge: Optional[JudgeConfig] = option(None, help="LLM judge as the reward source ([reward.judge] table)")
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
