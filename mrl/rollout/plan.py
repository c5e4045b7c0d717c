"""Engine groups and the prompt plan: which engine group generates which prompts, and where each
response goes back to. Pure functions of sizes, the same on every rank (no collectives here).

Layout. The world's ranks form consecutive engine groups of `ranks_per_engine` =
`rollout.tensor_parallel x rollout.pipeline_parallel` ranks: group g holds ranks
`[g * ranks_per_engine, (g + 1) * ranks_per_engine)`, which is how vLLM's `external_launcher`
forms its tensor/pipeline groups inside the torchrun world. The trainer's layout is independent:
its data-parallel (DP) ranks each own a list of prompts per step (the sampler's DP shard), and an
engine group may span several DP ranks (trainer TP1/DP2 feeding one TP2 engine) or a DP replica
may hold several engine groups (trainer TP2 feeding two TP1 engines).

Plan. Every DP rank's prompts, in DP-rank order, form one request list. `plan_prompts` cuts it
into one contiguous share per engine group, balanced by responses (a prompt asks for
`responses_per_prompt` of them): the share of group g is the prompts whose cumulative response
count midpoint falls in `[g, g + 1) x total / groups`, so shares differ by at most one prompt's
responses, and a group may get no prompt when there are fewer prompts than groups.
`PromptPlan.routes(dp_rank)` says, for each of that DP rank's prompts in order, which group
generated it and at which position of that group's share: the responses go back through it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class EngineGroups:
    """Consecutive groups of `ranks_per_engine` ranks over a world of `world_size`."""

    world_size: int
    ranks_per_engine: int

    def __post_init__(self):
        if self.ranks_per_engine < 1 or self.world_size < 1 or self.world_size % self.ranks_per_engine:
            raise ValueError(f"{self.ranks_per_engine} ranks per engine do not divide the world of {self.world_size}")

    @property
    def count(self) -> int:
        return self.world_size // self.ranks_per_engine

    def group_of(self, rank: int) -> int:
        return rank // self.ranks_per_engine

    def ranks(self, group: int) -> range:
        return range(group * self.ranks_per_engine, (group + 1) * self.ranks_per_engine)

    def leader(self, group: int) -> int:
        """The rank whose copy of the group's responses is sent back (all ranks of a group hold the same)."""
        return group * self.ranks_per_engine


# A prompt's address in the request list: (data-parallel rank that asked, its index in that rank's list).
PromptRef = tuple[int, int]


@dataclass(frozen=True)
class PromptPlan:
    """`shares[g]`: the prompts engine group g generates, in generation order."""

    shares: tuple[tuple[PromptRef, ...], ...]

    def responses_of(self, group: int, responses_per_prompt: Sequence[Sequence[int]]) -> int:
        return sum(responses_per_prompt[dp][i] for dp, i in self.shares[group])

    def routes(self, dp_rank: int) -> list[tuple[int, int]]:
        """(engine group, position in its share) for each prompt of `dp_rank`, in that rank's order."""
        found = {ref: (g, pos) for g, share in enumerate(self.shares) for pos, ref in enumerate(share) if ref[0] == dp_rank}
        return [found[(dp_rank, i)] for i in range(len(found))]


def plan_prompts(responses_per_prompt: Sequence[Sequence[int]], groups: int) -> PromptPlan:
    """Split the prompts of every DP rank (`responses_per_prompt[dp][i]`: responses prompt i of DP
    rank dp asks for) over `groups` engine groups: contiguous shares of the DP-ordered request
    list, balanced by responses."""
    if groups < 1:
        raise ValueError(f"need at least one engine group, got {groups}")
    refs = [(dp, i) for dp, counts in enumerate(responses_per_prompt) for i in range(len(counts))]
    weights = [responses_per_prompt[dp][i] for dp, i in refs]
    if any(w < 0 for w in weights):
        raise ValueError(f"negative response count in {responses_per_prompt}")
    total = sum(weights)
    shares: list[list[PromptRef]] = [[] for _ in range(groups)]
    before = 0
    for ref, w in zip(refs, weights):
        # midpoint rule in integers: group = floor((before + w/2) * groups / total)
        g = min((2 * before + w) * groups // (2 * total), groups - 1) if total else 0
        shares[g].append(ref)
        before += w
    return PromptPlan(tuple(tuple(s) for s in shares))
