"""A seeded, data-parallel-sharded, resumable sampler of prompt indices.

Every step consumes one global batch of `prompts_per_step` prompts: a contiguous slice of the
epoch's order (a permutation seeded by `(seed, epoch)`, so each epoch reshuffles and any epoch's
order can be rebuilt without replaying earlier ones). Rank `r` of `dp_size` takes the r-th equal
part of the global batch. A partial batch at the end of an epoch is skipped (every step has the
same size), so an epoch is `num_prompts // prompts_per_step` steps.

The state is only `(epoch, step_in_epoch)` plus the facts it depends on. It is normalized so that
finishing an epoch moves straight to `(epoch + 1, 0)`: a checkpoint taken exactly at an epoch
boundary resumes with the first batch of the next epoch instead of an exhausted iterator. The
order does not depend on `dp_size`, so a run may resume on a different number of ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mrl.errors import UserError


@dataclass(frozen=True)
class StepPrompts:
    """The prompts of one step for one rank."""

    epoch: int
    step_in_epoch: int
    indices: list[int]  # this rank's prompt indices into the dataset


class PromptSampler:
    """Infinite sequence of per-step prompt batches; see the module docstring."""

    def __init__(self, num_prompts: int, prompts_per_step: int, *, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, shuffle: bool = True):
        if prompts_per_step % dp_size:
            raise UserError(f"data.prompts_per_step {prompts_per_step} does not split over {dp_size} data-parallel ranks")
        if num_prompts < prompts_per_step:
            raise UserError(f"the dataset has {num_prompts} prompts, fewer than data.prompts_per_step {prompts_per_step}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        self.num_prompts = num_prompts
        self.prompts_per_step = prompts_per_step
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.steps_per_epoch = num_prompts // prompts_per_step
        self.epoch = 0
        self.step_in_epoch = 0
        self._order_epoch: int | None = None
        self._order: np.ndarray | None = None

    @property
    def steps_done(self) -> int:
        """Steps consumed since the start of training."""
        return self.epoch * self.steps_per_epoch + self.step_in_epoch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """All prompt indices in the order epoch `epoch` visits them."""
        if self._order_epoch != epoch:
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)
            else:
                self._order = np.arange(self.num_prompts)
            self._order_epoch = epoch
        return self._order

    def global_batch(self, epoch: int, step_in_epoch: int) -> list[int]:
        """The prompts every rank together consumes at `(epoch, step_in_epoch)`."""
        start = step_in_epoch * self.prompts_per_step
        return self.epoch_order(epoch)[start:start + self.prompts_per_step].tolist()

    def next(self) -> StepPrompts:
        """This rank's prompts for the next step; advances the state."""
        per_rank = self.prompts_per_step // self.dp_size
        batch = self.global_batch(self.epoch, self.step_in_epoch)
        out = StepPrompts(self.epoch, self.step_in_epoch, batch[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank])
        self.step_in_epoch += 1
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        return out

    def __iter__(self):
        while True:
            yield self.next()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "num_prompts": self.num_prompts,
                "prompts_per_step": self.prompts_per_step, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`. The dataset size, batch size, seed and shuffle must be unchanged:
        otherwise the saved position means other prompts, and resuming would silently repeat or skip some."""
        for key in ("num_prompts", "prompts_per_step", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise UserError(f"cannot resume the prompt sampler: {key} was {state[key]} when saved, "
                                f"is {getattr(self, key)} now")
        epoch, step = int(state["epoch"]), int(state["step_in_epoch"])
        if not 0 <= step <= self.steps_per_epoch:
            raise UserError(f"cannot resume the prompt sampler: step_in_epoch {step} outside [0, {self.steps_per_epoch}]")
        if step == self.steps_per_epoch:  # saved by a writer that did not normalize the boundary
            epoch, step = epoch + 1, 0
        self.epoch, self.step_in_epoch = epoch, step
