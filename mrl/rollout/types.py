"""What an engine is asked for (`Sampling`) and what it gives back (`Response`).

Both engines honour every field the same way, so a job can switch `rollout.engine` without
changing what the trainer sees.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

LogprobsMode = Literal["processed_logprobs", "raw_logprobs"]
FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Sampling:
    """How to sample the responses of one `generate` call.

    `temperature = 0` (or `greedy=True`) decodes greedily. `seed` makes the call reproducible on
    its own (each prompt gets a seed derived from it and its index); without it the engine's
    generator, seeded once at construction, advances from call to call.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: Optional[int] = None
    logprobs_mode: LogprobsMode = "processed_logprobs"

    def __post_init__(self):
        if self.n < 1 or self.max_tokens < 1:
            raise ValueError(f"n ({self.n}) and max_tokens ({self.max_tokens}) must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < -1 or self.top_k == 0 or not 0 <= self.min_p <= 1 \
                or self.repetition_penalty <= 0:
            raise ValueError(f"bad sampling values: {self}")
        if self.logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
            raise ValueError(f"unknown logprobs_mode {self.logprobs_mode!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def truncates(self) -> bool:
        """Whether top-k/top-p/min-p cut the sampled distribution (so processed != tempered softmax)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)


def prompt_seed(seed: int, prompt_index: int) -> int:
    """The per-prompt seed of a seeded call: distinct, well-mixed streams for neighbouring prompts."""
    return (seed * 0x9E3779B97F4A7C15 + prompt_index * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)


def resolve_prompt_seeds(sampling: Sampling, prompts: int, prompt_seeds=None) -> list[Optional[int]]:
    """Each prompt's seed for one `generate` call: `prompt_seeds` when the caller gives them (prompts
    gathered from several callers keep the seeds their own calls would have used), else
    `prompt_seed(sampling.seed, i)`, else None (the engine's own generator)."""
    if prompt_seeds is not None:
        if len(prompt_seeds) != prompts:
            raise ValueError(f"{len(prompt_seeds)} prompt seeds for {prompts} prompts")
        return [int(s) for s in prompt_seeds]
    if sampling.seed is None:
        return [None] * prompts
    return [prompt_seed(sampling.seed, i) for i in range(prompts)]


@dataclass
class Response:
    """One sampled response.

    `logprobs[i]` is the log-probability of `token_ids[i]` as defined by the call's
    `logprobs_mode` (see mrl/rollout/README.md). `finish_reason` is "stop" (EOS or a stop token,
    which is included as the last token) or "length" (max_tokens reached). `loss_mask` is 1 for
    sampled tokens and 0 for tokens the policy did not sample (tool outputs in multi-turn
    rollouts, whose `logprobs` entries are 0). `policy_version`: the trainer step whose weights
    generated its first token (a partial rollout continues under later ones).
    `routes` (MoE models, engines that return them): `[prompt + response tokens, moe_layers, top_k]`
    int16 expert indices the engine routed every token of the call's prompt and of the response
    to (`mrl.engine.routing`; routing replay R3).
    """

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    loss_mask: list[int] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    policy_version: Optional[int] = None   # the policy version of its first token (set by the RL loop)
    routes: Optional[Any] = None           # torch int16 [prompt + response tokens, MoE layers, top-k]

    def __post_init__(self):
        if not self.loss_mask:
            self.loss_mask = [1] * len(self.token_ids)
        if not len(self.token_ids) == len(self.logprobs) == len(self.loss_mask):
            raise ValueError("token_ids, logprobs and loss_mask must have the same length")


def routes_to(routes, tokens: int):
    """`routes` (a `Response.routes` of an earlier call over a prefix) for `tokens` tokens: rows
    past the prefix (tokens no engine call has fed yet, e.g. a tool's output that ends a
    conversation) are -1, "unknown" (`mrl.engine.routing`); None stays None."""
    if routes is None or routes.shape[0] == tokens:
        return routes
    if routes.shape[0] > tokens:
        raise ValueError(f"routes of {routes.shape[0]} tokens for {tokens} tokens")
    import torch

    extra = tokens - routes.shape[0]
    return torch.cat([routes, torch.full((extra, *routes.shape[1:]), -1, dtype=routes.dtype)])


def sampling_from_config(rollout, *, validation: bool = False, seed: Optional[int] = None) -> Sampling:
    """The `Sampling` a `[rollout]` section asks for (training or validation generations)."""
    if validation:
        v = rollout.validation
        return Sampling(n=v.responses_per_prompt, temperature=v.temperature if v.do_sample else 0.0,
                        top_p=v.top_p, top_k=v.top_k, max_tokens=rollout.max_response_tokens,
                        stop_token_ids=tuple(rollout.stop_token_ids), ignore_eos=rollout.ignore_eos,
                        seed=seed, logprobs_mode=rollout.logprobs_mode)
    return Sampling(n=rollout.responses_per_prompt, temperature=rollout.temperature if rollout.do_sample else 0.0,
                    top_p=rollout.top_p, top_k=rollout.top_k, min_p=rollout.min_p,
                    repetition_penalty=rollout.repetition_penalty,
                    max_tokens=rollout.max_response_tokens, stop_token_ids=tuple(rollout.stop_token_ids),
                    ignore_eos=rollout.ignore_eos, seed=seed, logprobs_mode=rollout.logprobs_mode)
