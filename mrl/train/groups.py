"""The groups a data-parallel shard has in hand while a step's batch fills (plain data).

A group is one prompt's `responses_per_prompt` responses, generated whole or advanced in rounds
of `rollout.partial_rollout_tokens` (`mrl.train.rollout.advance`; across steps: `mrl.train.carry`).
These types are a leaf module so the typed parts (`mrl.train.parts`) can name them without
importing the generation code.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mrl.rollout.types import Response


@dataclass
class GroupInProgress:
    """One prompt's `responses_per_prompt` responses while they are generated."""

    item: object                                   # the PromptItem
    tokens: list[list[int]]
    logprobs: list[list[float]]
    finish: list[Optional[str]]                    # None while generating
    versions: list[int]                            # the policy version of each response's first token
    carried: list[int] = field(default_factory=list)   # tokens each response brought from earlier steps
    scored: Optional[dict] = None                  # once kept: {"scores": [...]}
    whole: Optional[list[Response]] = None         # whole generation: the engine's responses as they came
    routes: list = field(default_factory=list)     # MoE routes of each response's latest call (`Response.routes`)
    masks: list = field(default_factory=list)      # server mode: each response's loss mask (empty: all 1)
    infos: list = field(default_factory=list)      # server mode: each trajectory's info (turns, tool counts, state)
    prescored: Optional[tuple] = None              # server mode, dynamic sampling: (scored, keep) as it finished

    @property
    def finished(self) -> bool:
        return all(f is not None for f in self.finish)

    def responses(self) -> list[Response]:
        if self.whole is not None:
            return self.whole
        from mrl.rollout.server import response_info

        return [Response(prompt_index=0, token_ids=list(self.tokens[j]), logprobs=list(self.logprobs[j]),
                         finish_reason=self.finish[j], policy_version=self.versions[j],
                         routes=self.routes[j] if self.routes else None,
                         loss_mask=list(self.masks[j]) if self.masks else [],
                         info=response_info(self.infos[j]) if self.infos else {})
                for j in range(len(self.finish))]

    @classmethod
    def new(cls, item, n: int, version: int) -> "GroupInProgress":
        return cls(item=item, tokens=[[] for _ in range(n)], logprobs=[[] for _ in range(n)], finish=[None] * n,
                   versions=[version] * n, carried=[0] * n, routes=[None] * n)

    @classmethod
    def generated(cls, item, responses: list[Response]) -> "GroupInProgress":
        """A group generated whole (every response finished)."""
        return cls(item=item, tokens=[list(r.token_ids) for r in responses],
                   logprobs=[list(r.logprobs) for r in responses], finish=[r.finish_reason or "stop" for r in responses],
                   versions=[r.policy_version for r in responses], carried=[0] * len(responses), whole=responses)


@dataclass
class ShardCarry:
    """What a shard has in hand: groups generating, and kept groups not yet trained."""

    active: list[GroupInProgress] = field(default_factory=list)
    ready: list[GroupInProgress] = field(default_factory=list)
