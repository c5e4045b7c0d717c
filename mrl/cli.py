"""The `mrl` command.

Exit codes: 0 success; 2 a user error (bad spec, data, reward function or command line), printed
as one line per problem with no traceback; 1 an internal error, printed with its traceback, or a
collective that timed out, printed as one line naming the stage.
"""
from __future__ import annotations

import argparse
import sys
import traceback

from mrl.errors import CollectiveTimeout, UserError


def _split_args(items: list[str]) -> tuple[list[str], list[str]]:
    """Job files and `key=value` overrides, in any order."""
    jobs = [a for a in items if "=" not in a]
    overrides = [a for a in items if "=" in a]
    if not jobs:
        raise UserError("no job file given (usage: mrl validate JOB.toml [key=value ...])")
    return jobs, overrides


def summary(spec) -> str:
    """One line with the layout and batch arithmetic a user wants to eyeball."""
    p, par, d, r = spec.platform, spec.parallel, spec.data, spec.rollout
    world = p.world_size
    dp = par.data_parallel(world)
    responses = d.prompts_per_step * r.responses_per_prompt
    mini = spec.actor.mini_batch_prompts
    return (f"world {world} = DP {dp} x TP {par.tensor} x PP {par.pipeline} x CP {par.context}"
            + (f" (EP {par.expert})" if par.expert > 1 else "")
            + f"; {d.prompts_per_step} prompts x {r.responses_per_prompt} = {responses} responses/step"
            + f"; {d.prompts_per_step // mini} optimizer step(s) of {mini} prompts x {spec.actor.epochs} epoch(s)"
            + f"; {spec.algorithm.advantage}/{spec.algorithm.policy_loss} on {r.engine}")


def cmd_validate(args) -> int:
    from mrl.config.loader import load

    jobs, overrides = _split_args(args.items)
    failed = 0
    for job in jobs:
        try:
            spec, report = load(job, overrides)
        except UserError as e:
            failed += 1
            for line in e.problems:
                print(f"error: {line}", file=sys.stderr)
            n = len(e.problems)
            print(f"{job}: {n} error{'s' if n != 1 else ''}", file=sys.stderr)
            continue
        for line in report.warnings:
            print(f"warning: {line}", file=sys.stderr)
        print(f"ok: {job}: {summary(spec)}")
    return 2 if failed else 0


def cmd_show(args) -> int:
    from mrl.config.dump import to_toml
    from mrl.config.loader import load

    jobs, overrides = _split_args(args.items)
    if len(jobs) != 1:
        raise UserError(f"mrl show takes one job file, got {len(jobs)}: {' '.join(jobs)}")
    spec, report = load(jobs[0], overrides)
    if args.get:
        value = spec
        for part in args.get.split("."):
            if not hasattr(value, part):
                raise UserError(f"{args.get}: no such key in the resolved spec")
            value = getattr(value, part)
        print(value if not isinstance(value, bool) else str(value).lower())
        return 0
    for line in report.warnings:
        print(f"# warning: {line}")
    sys.stdout.write(to_toml(spec))
    return 0


def cmd_keys(args) -> int:
    """Every key with its type, default and help, optionally under a prefix."""
    import dataclasses

    from rich.console import Console
    from rich.table import Table

    from mrl.config import schema
    from mrl.config.job import JobSpec

    table = Table("key", "type", "default", "meaning", show_lines=False)

    def walk(cls, prefix: str):
        for f in dataclasses.fields(cls):
            info = schema.fields_of(cls)[f.name]
            dotted = prefix + f.name
            sub = schema.section_of(info.type)
            if sub is not None:
                walk(sub, dotted + ".")
                continue
            if args.prefix and not dotted.startswith(args.prefix):
                continue
            if info.required:
                default = "(required)"
            elif f.default_factory is not dataclasses.MISSING:
                default = repr(f.default_factory())
            else:
                default = repr(f.default)
            table.add_row(dotted, schema.describe(info.type), default, info.meta.get("help", ""))

    walk(JobSpec, "")
    Console(width=200).print(table)
    return 0


def cmd_preflight(args) -> int:
    from mrl import preflight
    from mrl.config.loader import load

    jobs, overrides = _split_args(args.items)
    if len(jobs) != 1:
        raise UserError(f"mrl preflight takes one job file, got {len(jobs)}: {' '.join(jobs)}")
    spec, _ = load(jobs[0], overrides)
    preflight.run(spec)
    return 0


def cmd_train(args) -> int:
    from mrl.config.loader import load
    from mrl.train.loop import train

    jobs, overrides = _split_args(args.items)
    if len(jobs) != 1:
        raise UserError(f"mrl train takes one job file, got {len(jobs)}: {' '.join(jobs)}")
    spec, _ = load(jobs[0], overrides)
    train(spec)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mrl", description="Megatron-centric RL post-training for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="check job specs without running them; prints every error")
    p.add_argument("items", nargs="+", metavar="JOB|key=value", help="job files and dotted overrides")
    p.set_defaults(func=cmd_validate)
    p = sub.add_parser("show", help="print the fully resolved job spec as TOML")
    p.add_argument("items", nargs="+", metavar="JOB|key=value", help="a job file and dotted overrides")
    p.add_argument("--get", metavar="KEY", help="print only this resolved value (for scripts), e.g. platform.world_size")
    p.set_defaults(func=cmd_show)
    p = sub.add_parser("preflight", help="bring the job's platform up on its real layout and run one forward/backward "
                                         "(run under torchrun or srun with the job's world size)")
    p.add_argument("items", nargs="+", metavar="JOB|key=value", help="a job file and dotted overrides")
    p.set_defaults(func=cmd_preflight)
    p = sub.add_parser("train", help="run a job (under torchrun or srun with the job's world size; a 1-rank job "
                                     "also runs as a plain process); resumes from its latest checkpoint")
    p.add_argument("items", nargs="+", metavar="JOB|key=value", help="a job file and dotted overrides")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("keys", help="list every job-spec key with its type, default and meaning")
    p.add_argument("prefix", nargs="?", default="", help="only keys starting with this (e.g. rollout.)")
    p.set_defaults(func=cmd_keys)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        for line in e.problems:
            print(f"error: {line}", file=sys.stderr)
        return 2
    except CollectiveTimeout as e:  # a hang turned into an error: the message names the stage
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception:  # an mrl bug: show everything
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
