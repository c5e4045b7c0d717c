"""The rollout engine interface every backend implements, and the weight-stream bucketing.

An engine turns prompt token ids into sampled responses (token ids, the log-probability of each
sampled token, a finish reason), takes the trainer's weights as a stream of full Hugging
Face-named tensors, and can sleep (free memory for training) and wake up again.
"""
from __future__ import annotations

import abc
from typing import Iterable, Iterator, Optional, Sequence

import torch

from mrl.rollout.types import Response, Sampling

WeightStream = Iterable[tuple[str, torch.Tensor]]


class RolloutEngine(abc.ABC):
    """One generation engine (one per group of `rollout.tensor_parallel` ranks for vllm)."""

    @abc.abstractmethod
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: Sampling,
                 prompt_seeds: Optional[Sequence[int]] = None) -> list[Response]:
        """`sampling.n` responses per prompt, prompt-major: response `i * n + j` is sample j of prompt i.

        Prompt i samples from seed `prompt_seeds[i]` when given, else from
        `prompt_seed(sampling.seed, i)` (`mrl.rollout.types.resolve_prompt_seeds`)."""

    @abc.abstractmethod
    def sequence_logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """Teacher-forced log-probabilities of fixed sequences under the engine's current weights:
        `out[b][t-1] = log p(token_ids[b][t] | token_ids[b][:t])` from the raw logits (temperature 1),
        for t >= 1. What a weight sync is checked with: the trainer computes the same numbers."""

    @abc.abstractmethod
    def update_weights(self, weights: WeightStream, *, partial: bool = False) -> int:
        """Load HF-named full tensors from the stream into the engine; returns how many were loaded.
        Raises when a parameter of the engine's model received nothing, unless `partial` (a
        deliberate update of some tensors only)."""

    #: `apply_sparse` is implemented (delta syncs send changed elements; otherwise changed tensors whole)
    accepts_sparse = False

    def apply_sparse(self, name: str, indices: torch.Tensor, values: torch.Tensor) -> None:
        """Set elements `indices` of the flattened tensor `name` to `values` (a sparse delta sync)."""
        raise NotImplementedError(f"{type(self).__name__} takes no sparse weight updates")

    def load_unit(self, name: str) -> str:
        """The group of HF tensors `name` loads with: tensors of one unit must arrive in the same sync
        (a delta sync sends them all when one changed). Every tensor is its own unit unless the
        engine fuses them (vLLM: q/k/v into `qkv_proj`)."""
        return name

    def held_weights(self, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The engine's current tensors under their HF names (the periodic weight verification);
        `(name, None)` for a tensor the engine holds but cannot read back."""
        raise NotImplementedError(f"{type(self).__name__} cannot list its weights by HF name")

    @abc.abstractmethod
    def sleep(self, level: Optional[int] = None) -> None:
        """Free memory for training: 1 offloads weights and drops the KV cache, 2 drops both."""

    @abc.abstractmethod
    def wake(self, tags: Optional[Sequence[str]] = None) -> None:
        """Undo `sleep`; `tags` ("weights", "kv_cache") wakes only part (e.g. weights before an update)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release everything the engine holds; the object cannot be used afterwards."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def engine_group(ranks_per_engine: int):
    """(gloo group of this rank's engine, its first global rank), for everything an engine's ranks
    must agree on besides generation itself (e.g. tool results). Collective: every rank calls it.
    Engine g holds ranks [g * ranks_per_engine, (g + 1) * ranks_per_engine)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    if world % ranks_per_engine:
        raise ValueError(f"{ranks_per_engine} ranks per engine do not divide the world of {world}")
    mine = None
    for first in range(0, world, ranks_per_engine):
        group = dist.new_group(list(range(first, first + ranks_per_engine)), backend="gloo")
        if first <= rank < first + ranks_per_engine:
            mine = (group, first)
    return mine


def buckets(weights: WeightStream, bucket_mb: float) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a weight stream into lists of at most `bucket_mb` MiB (a larger tensor is a bucket alone)."""
    from mrl.weights.hf_export import hf_buckets

    return hf_buckets(weights, int(bucket_mb * 2**20))
