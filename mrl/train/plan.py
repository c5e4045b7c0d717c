"""The step plan: the layout and batch arithmetic of one RL step, resolved once from the spec.

Every number a step's stages divide by is computed here and nowhere else: the data-parallel
size, the prompts each trainer rank trains per step, each update's mini-batches and optimizer
steps, the rollout engine groups and their leaders. The producer (`mrl.train.produce`), the
update (`mrl.train.step`), evaluation (`mrl.train.evaluate`), the build (`mrl.train.build`),
`mrl validate` (`plan_problems`) and the CLI summary (`mrl.cli.common.summary`) all read one `StepPlan`.

A plan that does not divide is an error at validate time (`plan_problems`, one line naming the
key); `step_plan` refuses it the same way, so nothing downstream rounds a count.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mrl.rollout.layout import engine_world, trainer_world


@dataclass(frozen=True)
class Updates:
    """One model's optimizer steps within a training step (`actor` or `critic` section)."""

    prompts: int                 # prompts per optimizer step, over every data-parallel rank
    prompts_per_rank: int        # ... on one data-parallel rank
    mini_batches: int            # optimizer steps per epoch of one training step
    epochs: int

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps per training step."""
        return self.mini_batches * self.epochs

    def mini_batches_of(self, kept_prompts: int) -> int:
        """Mini-batches of a rank's batch of `kept_prompts` prompts: the plan's, or, when dynamic
        sampling ran out of rounds and proceeds with fewer prompts
        (`algorithm.dynamic_sampling.on_exhausted = "proceed"`), the most whole mini-batches
        that split the kept prompts evenly (at least one)."""
        if kept_prompts == self.prompts_per_rank * self.mini_batches:
            return self.mini_batches
        count = max(min(kept_prompts // self.prompts_per_rank, self.mini_batches), 1)
        while kept_prompts % count:
            count -= 1
        return count


@dataclass(frozen=True)
class StepPlan:
    world: int                   # every rank of the job
    trainer_world: int           # ranks that train
    engine_world: int            # ranks the rollout engines are laid out on
    dp: int                      # the trainer's data-parallel size
    prompts_per_step: int
    prompts_per_rank: int        # prompts one trainer data-parallel rank trains per step
    responses_per_prompt: int
    engine_ranks: int            # ranks per rollout engine group (tensor x pipeline)
    separate: bool               # rollout.placement = "separate"
    actor: Updates
    critic: Optional[Updates]    # None without a critic
    on_policy: bool = False      # see `on_policy`: old log-probs come from the update's own forward
    context: int = 1             # context-parallel ranks (parallel.context): each sequence in 2N chunks
    longest_sequence: int = 0    # data.max_prompt_tokens + rollout.max_response_tokens

    @property
    def tokens_per_rank(self) -> int:
        """Tokens of the longest sequence on one context-parallel rank (two of its 2N chunks)."""
        from mrl.models.context_parallel import tokens_per_rank

        return tokens_per_rank(self.longest_sequence, self.context)

    @property
    def responses_per_step(self) -> int:
        return self.prompts_per_step * self.responses_per_prompt

    @property
    def responses_per_rank(self) -> int:
        return self.prompts_per_rank * self.responses_per_prompt

    @property
    def engine_groups(self) -> int:
        return max(self.engine_world // self.engine_ranks, 1)

    def engine_group_of(self, rank: int) -> int:
        """The engine group of rank `rank` of the engines' world (groups are consecutive ranks)."""
        return rank // self.engine_ranks

    def engine_leader_of(self, rank: int) -> int:
        """The first rank of `rank`'s engine group (it scores for the group)."""
        return rank - rank % self.engine_ranks

    def shards_of_group(self, group: int) -> list[int]:
        """The trainer data-parallel ranks engine group `group` generates for (separate
        placement): every `engine_groups`-th one."""
        return list(range(group, self.dp, self.engine_groups))


def plan_problems(spec) -> list[tuple[str, str]]:
    """(dotted key, message) for every count of the step plan that does not divide. `mrl validate`
    reports them; `step_plan` refuses the first."""
    par, data, roll = spec.parallel, spec.data, spec.rollout
    world = trainer_world(roll, spec.platform.world_size)
    split = par.tensor * par.pipeline * par.context
    if world <= 0 or world % split:
        return []   # the parallel layout's own error (mrl.config.validate.check_shared)
    dp = world // split
    n, prompts = roll.responses_per_prompt, data.prompts_per_step
    where = f"data-parallel size {dp}"
    out: list[tuple[str, str]] = []
    if prompts % dp:
        out.append(("data.prompts_per_step", f"{prompts} prompts do not split evenly over {where}"))
    sections = [("actor", spec.actor)] + ([("critic", spec.critic)] if spec.critic.enable else [])
    for owner, section in sections:
        key, mini = f"{owner}.mini_batch_prompts", section.mini_batch_prompts
        if prompts % mini:
            out.append((key, f"{mini} does not divide data.prompts_per_step {prompts}"))
        if (mini * n) % dp:
            out.append((key, f"{mini} prompts x rollout.responses_per_prompt {n} = {mini * n} responses per mini-batch "
                             f"do not split evenly over {where} (training ranks {world} / (tensor {par.tensor} x "
                             f"pipeline {par.pipeline} x context {par.context}))"))
        elif mini % dp:
            out.append((key, f"{mini} prompts per mini-batch do not split evenly over {where}: each data-parallel rank "
                             "trains whole prompts (all their responses)"))
    return out


def budget_problems(spec) -> list[tuple[str, str]]:
    """(dotted key, message) for every token budget (per rank) that cannot hold the longest
    sequence: under context parallelism two of its 2N chunks (`mrl.models.context_parallel`)."""
    from mrl.models.context_parallel import tokens_per_rank   # the engine's CP chunking

    data, roll, cp = spec.data, spec.rollout, spec.parallel.context
    seq_tokens = data.max_prompt_tokens + roll.max_response_tokens
    per_rank = tokens_per_rank(seq_tokens, cp)
    budgets = [("actor.micro_batch_tokens", spec.actor.micro_batch_tokens),
               ("actor.logprob_micro_batch_tokens", spec.actor.logprob_micro_batch_tokens),
               ("ref.micro_batch_tokens", spec.ref.micro_batch_tokens)]
    if spec.critic.enable:
        budgets.append(("critic.micro_batch_tokens", spec.critic.micro_batch_tokens))
    how = (f", in {2 * cp} chunks of which each of the {cp} context-parallel ranks holds 2: {per_rank} tokens per rank"
           if cp > 1 else "")
    return [(key, f"{tokens} tokens per rank cannot hold one sequence of data.max_prompt_tokens {data.max_prompt_tokens} "
                  f"+ rollout.max_response_tokens {roll.max_response_tokens} = {seq_tokens} tokens{how}")
            for key, tokens in budgets if tokens is not None and tokens < per_rank]


def on_policy(spec, actor: Updates) -> bool:
    """Whether a step's actor update is one optimizer step on the weights that generated its
    responses, with nothing before the update needing the trainer's log-probs: one mini-batch,
    one epoch, no staleness (and no partial rollouts), no rollout correction or rejection, no KL
    in the reward, no optimal token baseline and no distillation (all read the trainer's log-probs before the
    update), no PF-PPO resampling (the update's rows are not the batch's), no critic warm-up (steps that do
    not update the actor), one pipeline stage. Then the update's first forward pass gives the old
    log-probs and the audit, and the separate forward pass is skipped (`mrl.train.step`). (No
    shuffle: the update's rows are the batch's, in order.)"""
    roll, alg, par = spec.rollout, spec.algorithm, spec.parallel
    return (actor.mini_batches == 1 and actor.epochs == 1 and not spec.actor.shuffle and roll.max_staleness == 0
            and not roll.partial_rollout_tokens and alg.correction.level == "off" and not alg.kl_reward.enable
            and alg.correction.rejection is None and not alg.pf_ppo.enable
            and alg.advantage not in ("optimal_token_baseline", "tir_optimal_token_baseline", "distill")
            and not (spec.critic.enable and spec.critic.warmup_steps) and par.pipeline == 1
            and not par.virtual_pipeline)


def step_plan(spec) -> StepPlan:
    """The plan of `spec` (resolved); a `UserError` naming the key when it does not divide."""
    from mrl.errors import UserError

    problems = plan_problems(spec)
    if problems:
        raise UserError(f"{problems[0][0]}: {problems[0][1]}")
    par, data, roll = spec.parallel, spec.data, spec.rollout
    world = trainer_world(roll, spec.platform.world_size)
    dp = par.data_parallel(world)
    prompts = data.prompts_per_step

    def updates(section) -> Updates:
        mini = section.mini_batch_prompts or prompts
        return Updates(prompts=mini, prompts_per_rank=mini // dp, mini_batches=prompts // mini,
                       epochs=section.epochs)

    actor = updates(spec.actor)
    return StepPlan(world=spec.platform.world_size, trainer_world=world,
                    engine_world=engine_world(roll, spec.platform.world_size), dp=dp, prompts_per_step=prompts,
                    prompts_per_rank=prompts // dp, responses_per_prompt=roll.responses_per_prompt,
                    engine_ranks=1 if roll.mode == "server" else roll.tensor_parallel * roll.pipeline_parallel, separate=roll.placement == "separate",
                    actor=actor, critic=updates(spec.critic) if spec.critic.enable else None,
                    on_policy=on_policy(spec, actor), context=par.context,
                    longest_sequence=data.max_prompt_tokens + roll.max_response_tokens)
