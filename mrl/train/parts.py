"""The typed parts of an RL run on one rank. Each owns its state; stages take only the parts they use.

- `Run`: the resolved job and this rank's place in it (read by every stage).
- `Learner`: the models that train or score on trainer ranks: the actor (and its weight
  exporter), the reference, the critic, a reward model, and the KL controller.
- `Generation`: the rollout engine on this rank, what generates with it, the rewarder, and the
  policy version the engine holds.
- `Prompts`: the training prompts, the samplers of the data-parallel shards this rank generates
  for, and the validation prompts.
- `SampleLog`: the sample rows a step wants logged.

`mrl.train.build` makes them from a job spec. With `rollout.placement = "colocated"` a rank holds
all of them; with "separate" a trainer rank holds `Learner` (no `Generation`) and a rollout rank
holds `Generation` and `Prompts` (no `Learner`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TYPE_CHECKING, Optional, Union

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from transformers import PreTrainedTokenizerBase

    from mrl.algos.kl import AdaptiveController, FixedController
    from mrl.config.job import JobSpec
    from mrl.data.prompts import PromptDataset
    from mrl.data.sampler import PromptSampler
    from mrl.engine import Engine
    from mrl.platform.runtime import Context
    from mrl.reward.compose import Rewarder
    from mrl.rollout.engine import RolloutEngine
    from mrl.rollout.multi_turn import MultiTurnRollout
    from mrl.rollout.plan import EngineGroups
    from mrl.rollout.weight_channel import ColocatedChannel
    from mrl.train.groups import ShardCarry
    from mrl.train.plan import StepPlan
    from mrl.train.teacher import Teacher
    from mrl.weights.hf_export import Exporter


@dataclass
class Run:
    """The resolved job and this rank's place in it."""

    spec: "JobSpec"
    ctx: "Context"
    hf: dict                        # the model's Hugging Face config
    tokenizer: "PreTrainedTokenizerBase"
    total_steps: int
    plan: "StepPlan"                # the step's layout and batch arithmetic (`mrl.train.plan`)
    images: Any = None              # a vision-language model's `mrl.data.images.ImageProcessor`

    @property
    def dp(self) -> int:
        """The trainer's data-parallel size (also known on rollout ranks)."""
        return self.plan.dp

    @property
    def separate(self) -> bool:
        return self.plan.separate


@dataclass
class Learner:
    """The models on a trainer rank."""

    actor: "Engine"
    exporter: "Exporter"            # the actor's HF-named weight stream
    ref: Optional["Engine"] = None
    critic: Optional["Engine"] = None
    reward_model: Optional["Engine"] = None   # value-head model scoring responses, on every rank
    kl: Optional[Union["AdaptiveController", "FixedController"]] = None   # algorithm.kl_reward
    teacher: Optional["Teacher"] = None      # [distill]: the frozen teacher (`mrl.train.teacher`)


@dataclass
class Generation:
    """The rollout engine on this rank and what scores its responses.

    Colocated: the hf engine lives on the model-parallel group's leader (`engine` is None on the
    other ranks of the group), vllm engines on every rank. Separate: every rollout rank holds its
    share of an engine; the first rank of each engine group scores.
    """

    engine: Optional["RolloutEngine"] = None
    generator: Optional[Union["RolloutEngine", "MultiTurnRollout"]] = None   # the engine, or a tool loop over it
    groups: Optional["EngineGroups"] = None   # vllm engine groups (None: one engine per leader)
    rewarder: Optional["Rewarder"] = None     # on leaders only
    rm_scores: Optional[PrecomputedScores] = None   # what the rewarder reads (reward model jobs)
    mp_group: Optional["ProcessGroup"] = None   # the group the leader broadcasts to (model-parallel, or engine)
    leader: int = 0                 # global rank of this rank's leader
    is_leader: bool = True
    weights_key: Optional[int] = None   # actor updates the engine's weights reflect (None: none loaded)
    version: int = 0                # policy version of the engine's weights (trainer steps completed)
    channel: Optional["ColocatedChannel"] = None   # colocated engines: checksummed full / delta syncs
    tool_schemas: Optional[list[dict]] = None   # the multi-turn tools the prompts list (`Prompts.tool_schemas`)
    driver_group: Optional["ProcessGroup"] = None   # rollout.router = "driver": the producing ranks (mrl.train.driver)


@dataclass
class Prompts:
    """Training prompts and the samplers of the data-parallel shards this rank generates for."""

    dataset: "PromptDataset"
    samplers: dict[int, "PromptSampler"]   # DP rank -> its sampler (colocated: this rank's own)
    val_dataset: Optional["PromptDataset"] = None
    carry: dict[int, "ShardCarry"] = field(default_factory=dict)   # DP rank -> groups in hand (partial rollouts)
    tool_schemas: Optional[list[dict]] = None   # the multi-turn tools the chat template lists (listed once, at build)

    @property
    def shards(self) -> list[int]:
        return sorted(self.samplers)

    @property
    def position(self) -> dict:
        """The data position (every shard's sampler moves in step)."""
        return next(iter(self.samplers.values())).state_dict()

    @property
    def epoch(self) -> int:
        return next(iter(self.samplers.values())).epoch

    def load_position(self, state: dict) -> None:
        for s in self.samplers.values():
            s.load_state_dict(state)


@dataclass
class SampleLog:
    """Rows of sampled prompts and responses waiting to be logged, per split."""

    rows: dict[str, list] = field(default_factory=dict)

    def put(self, split: str, rows: Optional[list]) -> None:
        if rows:
            self.rows[split] = rows

    def take(self, split: str) -> Optional[list]:
        return self.rows.pop(split, None)


class PrecomputedScores:
    """The rewarder's model scorer: the reward model runs on every rank of the model-parallel
    group (its collectives need them all) before the rewarder scores on the leader, which then
    reads the scores set here for the same sequences, in order."""

    def __init__(self):
        self.scores: Optional[list[float]] = None

    def __call__(self, token_ids: list[list[int]]) -> list[float]:
        if self.scores is None or len(self.scores) != len(token_ids):
            raise RuntimeError("reward-model scores were not computed for this batch")
        out, self.scores = self.scores, None
        return out
