"""What the commands share: job files and overrides on the command line, argument types, and the
one-line summary of a job (`mrl validate`, `mrl convert`)."""
from __future__ import annotations

import argparse

from mrl.errors import UserError


def split_args(items: list[str]) -> tuple[list[str], list[str]]:
    """Job files and `key=value` overrides, in any order."""
    jobs = [a for a in items if "=" not in a]
    overrides = [a for a in items if "=" in a]
    if not jobs:
        raise UserError("no job file given (usage: mrl validate JOB.toml [key=value ...])")
    return jobs, overrides


def one_job(args, command: str):
    """The resolved spec of the one job file (plus overrides) a command takes."""
    from mrl.config.loader import load

    jobs, overrides = split_args(args.items)
    if len(jobs) != 1:
        raise UserError(f"mrl {command} takes one job file, got {len(jobs)}: {' '.join(jobs)}")
    return load(jobs[0], overrides)[0]


def job_items(p: argparse.ArgumentParser) -> None:
    """The positional arguments of the commands that take one job: its file and dotted overrides."""
    p.add_argument("items", nargs="+", metavar="JOB|key=value", help="a job file and dotted overrides")


def count(text: str) -> int:
    """A command-line count: a whole number >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text}: must be >= 0")
    return value


def positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text}: must be > 0")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: must be between 0 and 1")
    return value


def summary(spec) -> str:
    """One line with the layout and batch arithmetic a user wants to eyeball."""
    if hasattr(spec, "sft"):
        from mrl.config.sft_job import summary as sft_summary

        return sft_summary(spec)
    from mrl.train.plan import step_plan

    p, par, r = spec.platform, spec.parallel, spec.rollout
    plan = step_plan(spec)
    world, dp, actor = plan.trainer_world, plan.dp, plan.actor
    split = (f"world {p.world_size} = {r.ranks} rollout + {world} training ranks; " if plan.separate else "")
    return (f"{split}{'training ' if split else ''}world {world} = DP {dp} x TP {par.tensor} x PP {par.pipeline} x CP {par.context}"
            + (f" (EP {par.expert})" if par.expert > 1 else "")
            + f"; {plan.prompts_per_step} prompts x {plan.responses_per_prompt} = {plan.responses_per_step} responses/step"
            + f"; {actor.mini_batches} optimizer step(s) of {actor.prompts} prompts x {actor.epochs} epoch(s)"
            + f"; {_objective(spec.algorithm)} on {r.engine}"
            + (f", max staleness {r.max_staleness}" if plan.separate else "")
            + (f"; CP {plan.context}: a {plan.longest_sequence}-token sequence in {2 * plan.context} chunks, "
               f"{plan.tokens_per_rank} tokens per rank" if plan.context > 1 else ""))


def _objective(alg) -> str:
    """`advantage/policy_loss`, or online DPO's `dpo:<loss> (<pairs> pairs)`."""
    if alg.objective == "dpo":
        return f"dpo:{alg.dpo.loss} ({alg.dpo.pairs} pairs)"
    return f"{alg.advantage}/{alg.policy_loss}"
