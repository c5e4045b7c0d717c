"""`mrl launch`: a one-machine job under torchrun, in this process."""
from __future__ import annotations

import sys

from mrl.cli.common import job_items, split_args
from mrl.errors import UserError


LAUNCHABLE = ("train", "sft", "preflight", "validate")  # subcommands that run on every rank


def cmd_launch(args) -> int:
    """One machine: check the job, then run `torchrun --standalone --nproc_per_node N -m mrl CMD JOB ...` (in this process)."""
    import os
    import shlex
    from pathlib import Path

    from mrl.config.loader import load

    run = args.run or os.environ.get("MRL_COMMAND") or "train"
    if run not in LAUNCHABLE:
        source = "--run" if args.run else "MRL_COMMAND"
        raise UserError(f"{source} {run}: mrl launch runs one of {', '.join(LAUNCHABLE)}")
    jobs, overrides = split_args(args.items)
    if len(jobs) != 1:
        raise UserError(f"mrl launch takes one job file, got {len(jobs)}: {' '.join(jobs)}")
    spec, _ = load(jobs[0], overrides)  # a bad spec fails here, before any rank starts
    if run == "train" and hasattr(spec, "sft") and not (args.run or os.environ.get("MRL_COMMAND")):
        run = "sft"   # an SFT job's default command
    nodes, ranks = spec.platform.nodes, spec.platform.ranks_per_node
    if nodes != 1:
        raise UserError(f"{jobs[0]}: platform.nodes = {nodes}; mrl launch runs one machine; launch multi-node jobs "
                        f"with: sbatch --nodes {nodes} --ntasks-per-node {ranks} launch/slurm.sh "
                        f"{shlex.join(args.items)}")
    torchrun = Path(sys.executable).with_name("torchrun")
    prefix = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    argv = [*prefix, "--standalone", "--nnodes", "1", "--nproc_per_node", str(ranks),
            "-m", "mrl", run, *args.items]
    if args.dry_run:
        print(shlex.join(argv))
        return 0
    from mrl.platform.lifetime import LAUNCHER_PID

    os.environ[LAUNCHER_PID] = str(os.getpid())   # this process is torchrun's agent: the ranks die with it
    return _run_torchrun(argv[argv.index("--standalone"):])


def _run_torchrun(torchrun_args: list[str]) -> int:
    """torchrun in this process. A failed rank has printed its own error (a user error once, from
    the lowest failing rank): exit with its code (2 for a user error) instead of torchrun's
    ChildFailedError report."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)   # its failure report
    try:
        run(parse_args(torchrun_args))
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        if 2 in codes:
            return 2
        _, first = e.get_first_failure()
        return first.exitcode if first.exitcode > 0 else 1
    return 0


def add(sub) -> None:
    """The parser of `mrl launch`."""
    p = sub.add_parser("launch", help="run a one-machine job under torchrun with the job's platform.ranks_per_node "
                                      "(multi-node jobs: launch/slurm.sh)")
    job_items(p)
    p.add_argument("--run", metavar="CMD", help="the mrl subcommand each rank runs: train, preflight or validate "
                                                "(default: $MRL_COMMAND, else train)")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command instead of running it")
    p.set_defaults(func=cmd_launch)


EXAMPLES: dict[str, tuple[str, ...]] = {   # under each command's --help
    "launch": ("mrl launch jobs/quickstart_cpu.toml",
               "mrl launch jobs/quickstart_cpu.toml --run preflight --dry-run"),
}
