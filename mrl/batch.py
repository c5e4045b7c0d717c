"""`Batch`: the one typed container that flows between the stages of a training step.

Layout (B = responses on this rank, P = prompt width, R = response width):

| field | shape | meaning |
| --- | --- | --- |
| `prompt_ids` | [B, P] long | prompt tokens, **left**-padded |
| `prompt_mask` | [B, P] | 1 = real prompt token |
| `response_ids` | [B, R] long | response tokens, **right**-padded |
| `response_lengths` | [B] long | tokens in the response, padding excluded (tool outputs included) |
| `response_mask` | [B, R] | 1 = token counts in the loss; 0 for padding and tool outputs |
| `group_index` | [B] long | prompt id within the step: the responses of one prompt share it |

Stages add fields, never rewrite one (`Batch.add` refuses an existing name): per-token
response tensors `[B, R]` (`rollout_logprobs`, `old_logprobs`, `ref_logprobs`, `values`,
`advantages`, `returns`, ...), per-response tensors `[B]` (`rewards`, ...), and per-response
metadata lists (`meta`, e.g. ground truths). The per-token log-prob at response position t is
`log p(response_ids[t] | prompt, response[<t])`.

Helpers cut a batch the ways the trainer needs: `dp_shard` (this data-parallel rank's
share), `mini_batches` (optimizer steps; all responses of a prompt stay together) and
`select` (any subset of responses, e.g. one packed micro-batch).
"""
from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

import torch

__all__ = ["Batch", "CORE_FIELDS"]

CORE_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_lengths", "response_mask", "group_index")


class Batch:
    """Padded tensors with a shared first dimension (responses) plus per-response metadata."""

    __slots__ = ("tensors", "meta")

    def __init__(self, tensors: dict[str, torch.Tensor], meta: Optional[dict[str, list]] = None):
        missing = [k for k in CORE_FIELDS if k not in tensors]
        if missing:
            raise ValueError(f"Batch needs fields {missing}")
        n = tensors["prompt_ids"].shape[0]
        r = tensors["response_ids"].shape[1]
        for k, v in tensors.items():
            if v.shape[0] != n:
                raise ValueError(f"Batch field {k!r} has {v.shape[0]} rows, expected {n}")
        for k in ("response_mask",):
            if tensors[k].shape != (n, r):
                raise ValueError(f"Batch field {k!r} must be [B, R] = [{n}, {r}], got {tuple(tensors[k].shape)}")
        if tensors["prompt_mask"].shape != tensors["prompt_ids"].shape:
            raise ValueError("Batch prompt_mask must have prompt_ids' shape")
        meta = dict(meta or {})
        for k, v in meta.items():
            if len(v) != n:
                raise ValueError(f"Batch metadata {k!r} has {len(v)} entries, expected {n}")
        self.tensors = dict(tensors)
        self.meta = meta

    # ---- construction

    @classmethod
    def from_sequences(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *,
                       group_index: Optional[Sequence[int]] = None,
                       loss_masks: Optional[Sequence[Sequence[int]]] = None, pad_id: int = 0) -> "Batch":
        """Pad lists of token ids into a `Batch` (prompts left-padded, responses right-padded).

        `loss_masks` (one 0/1 per response token) defaults to all ones; `group_index` to one
        group per response.
        """
        n = len(prompts)
        if len(responses) != n:
            raise ValueError(f"{n} prompts but {len(responses)} responses")
        p_width = max((len(p) for p in prompts), default=0)
        r_width = max(1, max((len(r) for r in responses), default=0))
        prompt_ids = torch.full((n, p_width), pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((n, p_width), dtype=torch.long)
        response_ids = torch.full((n, r_width), pad_id, dtype=torch.long)
        response_mask = torch.zeros((n, r_width), dtype=torch.long)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            if len(p):
                prompt_ids[i, p_width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
                prompt_mask[i, p_width - len(p):] = 1
            if len(r):
                response_ids[i, :len(r)] = torch.as_tensor(list(r), dtype=torch.long)
                m = loss_masks[i] if loss_masks is not None else [1] * len(r)
                if len(m) != len(r):
                    raise ValueError(f"response {i}: loss mask has {len(m)} entries for {len(r)} tokens")
                response_mask[i, :len(r)] = torch.as_tensor(list(m), dtype=torch.long)
        groups = torch.as_tensor(list(group_index) if group_index is not None else range(n), dtype=torch.long)
        return cls({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
                    "response_lengths": torch.as_tensor([len(r) for r in responses], dtype=torch.long),
                    "response_mask": response_mask, "group_index": groups})

    # ---- access

    def __len__(self) -> int:
        return self.tensors["prompt_ids"].shape[0]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors or name in self.meta

    def get(self, name: str, default: Any = None) -> Any:
        return self.tensors.get(name, self.meta.get(name, default))

    @property
    def prompt_lengths(self) -> torch.Tensor:
        """Real prompt tokens per response [B]."""
        return self.tensors["prompt_mask"].sum(-1).long()

    @property
    def sequence_lengths(self) -> torch.Tensor:
        """Tokens the model sees per response [B]: prompt + response, padding excluded."""
        return self.prompt_lengths + self.tensors["response_lengths"].long()

    @property
    def response_width(self) -> int:
        return self.tensors["response_ids"].shape[1]

    # ---- growth

    def add(self, **fields: Any) -> "Batch":
        """A new batch with extra fields (tensors with B rows, or lists of B metadata entries);
        adding a name that exists is an error (stages never rewrite each other's fields)."""
        clash = [k for k in fields if k in self]
        if clash:
            raise ValueError(f"Batch already has {clash}; stages add fields, never rewrite them")
        tensors, meta = dict(self.tensors), dict(self.meta)
        for k, v in fields.items():
            (tensors if isinstance(v, torch.Tensor) else meta)[k] = v if isinstance(v, torch.Tensor) else list(v)
        return Batch(tensors, meta)

    # ---- cutting

    def select(self, index: torch.Tensor | Sequence[int]) -> "Batch":
        """The responses at `index` (in that order), every field kept."""
        idx = torch.as_tensor(index, dtype=torch.long)
        tensors = {k: v.index_select(0, idx.to(v.device)) for k, v in self.tensors.items()}
        meta = {k: [v[i] for i in idx.tolist()] for k, v in self.meta.items()}
        return Batch(tensors, meta)

    def to(self, device: torch.device | str) -> "Batch":
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, self.meta)

    def dp_shard(self, dp_rank: int, dp_size: int) -> "Batch":
        """This data-parallel rank's contiguous share of a batch every rank holds whole.

        Prompts (groups) are dealt out whole, so the responses of one prompt stay on one rank;
        the number of groups must divide by `dp_size`.
        """
        groups = self._group_order()
        if len(groups) % dp_size:
            raise ValueError(f"{len(groups)} prompts do not split over {dp_size} data-parallel ranks")
        per = len(groups) // dp_size
        return self.select([i for g in groups[dp_rank * per:(dp_rank + 1) * per] for i in g])

    def mini_batches(self, count: int, *, shuffle: bool = False,
                     generator: Optional[torch.Generator] = None) -> list["Batch"]:
        """Split into `count` mini-batches of whole prompts (all responses of a prompt together).

        With `shuffle` the prompts are permuted first (by `generator`); otherwise their order of
        first appearance is kept. The number of prompts must divide by `count`.
        """
        groups = self._group_order()
        if count < 1 or len(groups) % count:
            raise ValueError(f"{len(groups)} prompts do not split into {count} mini-batches")
        if shuffle:
            groups = [groups[i] for i in torch.randperm(len(groups), generator=generator).tolist()]
        per = len(groups) // count
        return [self.select([i for g in groups[k * per:(k + 1) * per] for i in g]) for k in range(count)]

    def _group_order(self) -> list[list[int]]:
        """Response indices per prompt, prompts in order of first appearance."""
        order: dict[int, list[int]] = {}
        for i, g in enumerate(self.tensors["group_index"].tolist()):
            order.setdefault(g, []).append(i)
        return list(order.values())

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}{list(v.shape)}" for k, v in self.tensors.items())
        meta = f"; meta {sorted(self.meta)}" if self.meta else ""
        return f"Batch({len(self)} responses: {shapes}{meta})"
