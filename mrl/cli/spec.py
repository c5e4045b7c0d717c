"""`mrl validate` and `mrl show`: check job specs, print one resolved."""
from __future__ import annotations

import sys

from mrl.cli.common import job_items, split_args, summary
from mrl.errors import UserError


def cmd_validate(args) -> int:
    from mrl.config.loader import load

    jobs, overrides = split_args(args.items)
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
    from mrl.schema.dump import to_toml
    from mrl.config.loader import load

    jobs, overrides = split_args(args.items)
    if len(jobs) != 1:
        raise UserError(f"mrl show takes one job file, got {len(jobs)}: {' '.join(jobs)}")
    spec, report = load(jobs[0], overrides)
    if args.get:
        for key in args.get:
            value = spec
            for part in key.split("."):
                if not hasattr(value, part):
                    raise UserError(f"{key}: no such key in the resolved spec")
                value = getattr(value, part)
            print(_get_text(value))
        return 0
    for line in report.warnings:
        print(f"# warning: {line}")
    sys.stdout.write(to_toml(spec))
    return 0


def _get_text(value) -> str:
    """One resolved value as `mrl show --get` prints it for scripts: scalars as they are (booleans
    as TOML writes them, unset as an empty line), lists as space-separated shell words, tables
    (a dict, or a whole section) as one line of JSON."""
    import dataclasses
    import json
    import shlex

    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return shlex.join(str(v) for v in value)
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return json.dumps(value, default=str)
    return str(value)


def add(sub) -> None:
    """The parsers of `mrl validate`, `mrl show`."""
    p = sub.add_parser("validate", help="check job specs without running them; prints every error")
    p.add_argument("items", nargs="+", metavar="JOB|key=value", help="job files and dotted overrides")
    p.set_defaults(func=cmd_validate)
    p = sub.add_parser("show", help="print the fully resolved job spec as TOML")
    job_items(p)
    p.add_argument("--get", metavar="KEY", action="append",
                   help="print only this resolved value (for scripts; repeat for several, one line each; a list as "
                        "space-separated shell words, a table as JSON, an unset value as an empty line), e.g. "
                        "platform.world_size")
    p.set_defaults(func=cmd_show)


EXAMPLES: dict[str, tuple[str, ...]] = {   # under each command's --help
    "validate": ("mrl validate jobs/quickstart_cpu.toml",
                 "mrl validate my_job.toml actor.optim.lr=2e-6 'data.train_files=[a.parquet, b.parquet]'"),
    "show": ("mrl show jobs/quickstart_cpu.toml                 # the whole resolved job as TOML",
             "mrl show jobs/quickstart_cpu.toml --get platform.world_size --get tracking.backends"),
}
