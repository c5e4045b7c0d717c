"""The server-mode engine interface: one request per trajectory turn, awaited on its own.

A server-mode engine (`rollout.mode = "server"`) is one continuously batching engine per engine
group, driven asynchronously from the trainer side: every trajectory is its own coroutine that
awaits `generate` for each of its turns, so a slow tool call or a long turn holds nobody else.
Backends: vLLM's `AsyncLLM` and SGLang's HTTP server. The synchronous `RolloutEngine` interface
(`engine.py`) stays for `rollout.mode = "spmd"`.

Requests carry token ids in and give token ids out (the engine's ids are never re-tokenized), one
sampled continuation each (`sampling.n == 1`; a group is n requests, so each can be aborted alone).
Weights arrive between `pause()` and `resume()`: in-flight requests are held (or aborted, as the
caller asks), the verified weight stream is loaded, and generation resumes under the new version.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence

from mrl.rollout.engine import WeightStream
from mrl.rollout.types import Sampling

#: "abort": the request was aborted (over-sampling's surplus, a pause that aborts, a shutdown);
#: its tokens so far are returned and may be continued later as a partial rollout.
AsyncFinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class GenRequest:
    """One turn of one trajectory: continue `prompt_ids` by at most `sampling.max_tokens` tokens."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: Sampling
    #: the request's own seed (reproducible per trajectory turn, independent of arrival order)
    seed: Optional[int] = None
    #: the prompt's `mrl.data.images.ImageInputs` (vision-language models; None: text). Every turn
    #: of a trajectory carries its prompt's images: `prompt_ids` starts with that prompt.
    images: Any = None

    def __post_init__(self):
        if self.sampling.n != 1:
            raise ValueError(f"a server-mode request samples one continuation, not n={self.sampling.n}")
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id!r} has no prompt tokens")


@dataclass
class GenResult:
    """What one request produced: `logprobs[i]` belongs to `token_ids[i]` (as `Response.logprobs`)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: AsyncFinishReason
    #: the engine's weight version when the request's first token was sampled
    weight_version: Optional[int] = None
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError("token_ids and logprobs must have the same length")


class AsyncEngine(abc.ABC):
    """One continuously batching engine (one per engine group) behind an async request API."""

    @abc.abstractmethod
    async def generate(self, request: GenRequest) -> GenResult:
        """Run one request to its end (stop, length) or until it is aborted (`finish_reason="abort"`)."""

    @abc.abstractmethod
    async def abort(self, request_ids: Sequence[str]) -> None:
        """Abort these requests if they are still running; their `generate` calls return what they have."""

    @abc.abstractmethod
    async def pause(self, *, abort_running: bool = False) -> None:
        """Stop scheduling new tokens (before a weight update). Running requests wait, or are aborted."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Continue generating after `pause` (and a weight update)."""

    @abc.abstractmethod
    def update_weights(self, weights: WeightStream, *, partial: bool = False) -> int:
        """Load HF-named full tensors while paused; as `RolloutEngine.update_weights`."""

    @abc.abstractmethod
    def sleep(self, level: Optional[int] = None) -> None:
        """Free memory for training (colocated placement); as `RolloutEngine.sleep`."""

    @abc.abstractmethod
    def wake(self, tags: Optional[Sequence[str]] = None) -> None:
        """Undo `sleep`; as `RolloutEngine.wake`."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release everything the engine holds (processes, sockets, memory)."""

    def load_unit(self, name: str) -> str:
        """As `RolloutEngine.load_unit`: tensors loaded together must be sent together."""
        return name
