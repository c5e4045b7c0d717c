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
            + (f", max staleness {r.max_staleness}" if plan.separate else ""))


def _objective(alg) -> str:
    """`advantage/policy_loss`, or online DPO's `dpo:<loss> (<pairs> pairs)`."""
    if alg.objective == "dpo":
        return f"dpo:{alg.dpo.loss} ({alg.dpo.pairs} pairs)"
    return f"{alg.advantage}/{alg.policy_loss}"


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
    from mrl.schema.dump import to_toml
    from mrl.config.loader import load

    jobs, overrides = _split_args(args.items)
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


def cmd_keys(args) -> int:
    """Every key with its type, default and help, optionally under a prefix: a table sized to the
    terminal (wide when piped), or `--json` for scripts."""
    import dataclasses
    import json

    from rich.console import Console
    from rich.table import Table

    from mrl.schema.section import fields_of, section_of
    from mrl.schema.value import describe
    from mrl.config.job import JobSpec
    from mrl.config.loader import PATHS_HELP

    if args.verl:
        return _verl_keys(args.prefix, args.json)
    rows: list[dict] = []

    def walk(cls, prefix: str):
        for f in dataclasses.fields(cls):
            info = fields_of(cls)[f.name]
            dotted = prefix + f.name
            sub = section_of(info.type)
            if sub is not None:
                walk(sub, dotted + ".")
                continue
            if args.prefix and not dotted.startswith(args.prefix):
                continue
            if info.required:
                default = None
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = f.default
            rows.append({"key": dotted, "type": describe(info.type), "required": info.required,
                         "default": list(default) if isinstance(default, tuple) else default,
                         "meaning": info.meta.get("help", "")})

    walk(JobSpec, "")
    from mrl.sft.config import SFTConfig

    walk(SFTConfig, "sft.")   # the section of SFT jobs (`mrl sft`); the other sections are shared
    if not rows:
        from mrl.config.verl_table import verl_table

        hint = (f"; it is a verl name: `mrl keys --verl {args.prefix}` shows the mrl keys it maps to"
                if verl_table().rows(args.prefix) else "")
        raise UserError(f"{args.prefix}: no mrl key starts with this{hint}")
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    table = Table("key", "type", "default", "meaning", show_lines=False, caption=PATHS_HELP.capitalize() + ".")
    for r in rows:
        default = "(required)" if r["required"] else repr(tuple(r["default"]) if isinstance(r["default"], list)
                                                          else r["default"])
        table.add_row(r["key"], r["type"], default, r["meaning"])
    console = Console() if sys.stdout.isatty() else Console(width=200)   # the terminal's width; wide in pipes
    console.print(table)
    return 0


def _verl_keys(prefix: str, as_json: bool) -> int:
    """`mrl keys --verl`: the verl key table (mrl/config/verl_keys.toml)."""
    import json

    from rich.console import Console
    from rich.table import Table

    from mrl.config.verl_table import verl_table

    rows = verl_table().rows(prefix)
    if not rows:
        raise UserError(f"{prefix}: no verl key in mrl's table starts with this (`mrl keys --verl` lists them all)")
    if as_json:
        print(json.dumps([{"verl": v, "mrl": m, "how": h} for v, m, h in rows], indent=1))
        return 0
    table = Table("verl key", "mrl key", "value translation, or why there is none",
                  caption="mrl convert translates a verl config with this table (mrl/config/verl_keys.toml).")
    for row in rows:
        table.add_row(*row)
    (Console() if sys.stdout.isatty() else Console(width=220)).print(table)
    return 0


def cmd_convert(args) -> int:
    """A verl config (YAML, command line or script) -> one commented mrl job, then validated."""
    import tempfile
    from pathlib import Path

    from mrl.config.loader import load
    from mrl.convert import convert, inputs, render
    from mrl.outputs import check_output

    found = inputs(args.items)
    if args.out:   # before any work: not an input, not in a checkpoint, not an existing file without --force
        check_output(args.out, what="mrl convert -o", inputs=[i for i in args.items if "=" not in i], force=args.force)
    conv = convert(found.yamls, found.tokens, config_name=found.config_name, describe=found.describe)
    conv.notes = found.notes + conv.notes
    if conv.refused:      # a capability mrl lacks: no job is written
        raise UserError(f"refused: {conv.refused[0]}" + (f" (and {len(conv.refused) - 1} more)" if len(conv.refused) > 1 else ""))
    text = render(conv, list_dropped=args.all)
    if args.out:
        out = Path(args.out)
        out.write_text(text, encoding="utf-8")
        shown = str(out)
    else:
        sys.stdout.write(text)
        shown = "the job"
    with tempfile.TemporaryDirectory() as tmp:   # paths in the job are absolute: it validates anywhere
        job = Path(tmp) / (Path(args.out).name if args.out else "converted.toml")
        job.write_text(text, encoding="utf-8")
        try:
            spec, _ = load(job)
            problems = list(conv.problems)
        except UserError as e:
            spec, problems = None, [*conv.problems, *(p.replace(str(job), shown) for p in e.problems)]
    print(f"{shown}: {len(conv.values)} mrl keys from {len(conv.sources)} input(s); {len(conv.not_converted)} verl keys "
          f"with no mrl counterpart and {len(conv.not_read)} verl would not read (listed as comments); "
          f"{len(conv.dropped)} defaults dropped", file=sys.stderr)
    if problems:
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
        print(f"{shown}: supply or fix the values above (in the file, or as key=value after `mrl validate`)",
              file=sys.stderr)
        return 2
    print(f"ok: {shown}: {summary(spec)}", file=sys.stderr)
    return 0


def _one_job(args, command: str):
    """The resolved spec of the one job file (plus overrides) a command takes."""
    from mrl.config.loader import load

    jobs, overrides = _split_args(args.items)
    if len(jobs) != 1:
        raise UserError(f"mrl {command} takes one job file, got {len(jobs)}: {' '.join(jobs)}")
    return load(jobs[0], overrides)[0]


def cmd_plan(args) -> int:
    """The weight sync's bytes, buckets, groups, memory and estimated time, from the model config only."""
    from mrl.weights.sync_plan import Links, plan_text

    jobs, _ = _split_args(args.items)
    spec = _one_job(args, "plan")
    links = Links(nvlink_gbps=args.nvlink_gbps, ib_gbps=args.ib_gbps, pcie_gbps=args.pcie_gbps)
    print(plan_text(spec, jobs[0], links, args.changed_fraction))
    return 0


def cmd_preflight(args) -> int:
    from mrl import preflight

    preflight.run(_one_job(args, "preflight"))
    return 0


def cmd_train(args) -> int:
    from pathlib import Path

    from mrl.tracking.startup import STARTUP   # the first line, before torch is imported

    STARTUP.start()
    STARTUP.say(f"mrl train {' '.join(_split_args(args.items)[0])}: checking the job")
    spec = _one_job(args, "train")
    if hasattr(spec, "sft"):
        raise UserError(f"{_split_args(args.items)[0][0]}: an SFT job (it has an [sft] section): run it with `mrl sft`")
    STARTUP.say(f"spec ok: run directory {(Path(spec.job.output_dir) / spec.job.name).resolve()}", timed=True)
    from mrl.train.loop import train

    train(spec)
    return 0


def cmd_sft(args) -> int:
    from pathlib import Path

    from mrl.tracking.startup import STARTUP   # the first line, before torch is imported

    STARTUP.start()   # the phases of `mrl train`, and weight-loading progress lines, on rank 0
    STARTUP.say(f"mrl sft {' '.join(_split_args(args.items)[0])}: checking the job")
    spec = _one_job(args, "sft")
    if not hasattr(spec, "sft"):
        raise UserError(f"{_split_args(args.items)[0][0]}: not an SFT job (no [sft] section): RL jobs run with `mrl train`")
    STARTUP.say(f"spec ok: run directory {(Path(spec.job.output_dir) / spec.job.name).resolve()}", timed=True)
    from mrl.sft.loop import sft

    sft(spec)
    return 0


def cmd_merge(args) -> int:
    import logging

    from mrl.merge import merge
    from mrl.outputs import check_output

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    check_output(args.out, what="mrl merge: output", kind="dir", inputs=[args.checkpoint])
    report = merge(args.checkpoint, args.out, max_shard_size=args.max_shard_size, dtype=args.dtype,
                   verify=args.verify, model=args.model, format=args.format)
    print(report.summary())
    return 0


def _target(args, command: str):
    """The job and checkpoint `mrl eval` / `mrl generate` use (`mrl.offline.target`)."""
    from mrl.offline.target import resolve

    sources = [a for a in args.items if "=" not in a]
    if len(sources) != 1:
        raise UserError(f"mrl {command} takes one job file or run directory, got {len(sources)}: {' '.join(sources)}")
    return resolve(sources[0], [a for a in args.items if "=" in a], args.step, command)


def cmd_eval(args) -> int:
    """Validate a checkpoint (the latest, or --step N; the job's model.path when none) as training does."""
    import json
    from pathlib import Path

    from mrl.offline.evaluate import evaluate_target
    from mrl.outputs import check_output

    if args.json:
        check_output(args.json, what="mrl eval --json", force=args.force)
    report = evaluate_target(_target(args, "eval"))
    print(report.table())
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_json(), indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


def cmd_generate(args) -> int:
    """Responses of a checkpoint's policy to --prompt / --prompts / the job's data (--from-data, the
    default), scored with the job's reward where answers are known; JSONL (stdout or --out) or parquet."""
    import json

    from mrl.offline.generate import Request, SamplingOverrides, from_data, generate_rows, read_requests, write_rows

    given = [name for name, v in (("--prompt TEXT", args.prompt), ("--prompts FILE.jsonl", args.prompts),
                                  ("--from-data [N]", args.from_data)) if v is not None]
    if len(given) > 1:
        raise UserError(f"mrl generate takes one of --prompt TEXT, --prompts FILE.jsonl or --from-data [N], got "
                        f"{' and '.join(given)}")
    if args.split is not None and (args.prompt is not None or args.prompts is not None):
        raise UserError("mrl generate: --split picks the job's data (--from-data); it does not apply to --prompt(s)")
    if args.out:
        from mrl.outputs import check_output

        check_output(args.out, what="mrl generate --out", inputs=[args.prompts] if args.prompts else [],
                     force=args.force)
    target = _target(args, "generate")
    if args.prompt is not None:
        prompts = [Request(args.prompt)]
    elif args.prompts is not None:
        prompts = read_requests(args.prompts)
    else:   # the job's own prompts, with their answers
        prompts = from_data(target.spec, args.from_data, args.split)
    rows = generate_rows(target, prompts, SamplingOverrides(n=args.n, temperature=args.temperature,
                                                            max_tokens=args.max_tokens), scored=not args.no_score)
    if args.out:
        write_rows(rows, args.out)
        scored = [r["score"] for r in rows if "score" in r]
        mean = f", mean score {sum(scored) / len(scored):.4g}" if scored else ""
        print(f"wrote {len(rows)} responses to {args.out} ({target.label}{mean})")
    else:
        print("\n".join(json.dumps(row, ensure_ascii=False) for row in rows))
    return 0


def cmd_compare(args) -> int:
    from mrl.compare import compare
    from mrl.outputs import check_output

    if args.out:   # a directory of PNG plots: not a file, not inside a checkpoint
        check_output(args.out, what="mrl compare --out", kind="dir")
    compare(args.runs, tracking_uris=args.tracking_uri or (), metrics=args.metrics, out=args.out)
    return 0


def cmd_track(args) -> int:
    """`mrl track replay RUN_DIR`: write the tracker writes a run dropped into its MLflow store."""
    import logging

    from mrl.tracking.journal import replay

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    report = replay(args.run_dir, tracking_uri=args.tracking_uri)
    print(report.summary())
    return 1 if report.failed else 0


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
    jobs, overrides = _split_args(args.items)
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


def cmd_data(args) -> int:
    """Write verl-format parquet files (`mrl.data.prepare`) and say where, with their row counts."""
    import tomllib
    from pathlib import Path

    from mrl.data import prepare
    from mrl.outputs import check_output

    if args.kind == "gym":
        options = {}
        for item in args.option:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise UserError(f"--option {item!r}: expected KEY=VALUE")
            try:
                options[key] = tomllib.loads(f"v = {value}")["v"]
            except tomllib.TOMLDecodeError:
                options[key] = value
        system = None if args.system_prompt == "none" else args.system_prompt
        sizes = [("train", args.train_size, args.seed), ("test", args.test_size, args.seed + 1)]
        if not any(size for _, size, _ in sizes):
            raise UserError("mrl data gym: --train-size and --test-size are both 0: nothing to write")
        check_output(args.out, what="mrl data: OUT", kind="dir", force=args.force,
                     writes=[f"{split}.parquet" for split, size, _ in sizes if size > 0])
        written = [prepare.write_rows(prepare.gym_rows(args.task, size, seed, split, options, system),
                                      Path(args.out) / f"{split}.parquet") for split, size, seed in sizes if size > 0]
    else:
        written = prepare.prepare_shaped(args.kind, args.source, args.out, subset=args.subset, splits=tuple(args.split),
                                         data_source=args.data_source, force=args.force)
    import pyarrow.parquet as pq

    for path in written:
        print(f"{path}: {pq.ParquetFile(path).metadata.num_rows} rows")
    return 0


def _count(text: str) -> int:
    """A command-line count: a whole number >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text}: must be >= 0")
    return value


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text}: must be > 0")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: must be between 0 and 1")
    return value


def _job_items(p: argparse.ArgumentParser) -> None:
    """The positional arguments of the commands that take one job: its file and dotted overrides."""
    p.add_argument("items", nargs="+", metavar="JOB|key=value", help="a job file and dotted overrides")


def _checkpoint_target_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments `mrl eval` and `mrl generate` share: what to load (`mrl.offline.target`)."""
    p.add_argument("items", nargs="+", metavar="JOB|RUN_DIR|key=value",
                   help="a job file or a run directory (<job.output_dir>/<job.name>), and dotted overrides")
    p.add_argument("--step", type=int, default=None, metavar="N", help="the checkpoint of step N (default: the latest)")


def build_parser() -> argparse.ArgumentParser:
    from mrl import __version__
    from mrl.config.loader import PATHS_HELP
    from mrl.offline.generate import DATA_PROMPTS

    parser = argparse.ArgumentParser(prog="mrl", description="Megatron-centric RL post-training for LLMs.",
                                     epilog=f"Job specs: {PATHS_HELP}.")
    parser.add_argument("--version", action="version", version=f"mrl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="check job specs without running them; prints every error")
    p.add_argument("items", nargs="+", metavar="JOB|key=value", help="job files and dotted overrides")
    p.set_defaults(func=cmd_validate)
    p = sub.add_parser("show", help="print the fully resolved job spec as TOML")
    _job_items(p)
    p.add_argument("--get", metavar="KEY", action="append",
                   help="print only this resolved value (for scripts; repeat for several, one line each; a list as "
                        "space-separated shell words, a table as JSON, an unset value as an empty line), e.g. "
                        "platform.world_size")
    p.set_defaults(func=cmd_show)
    p = sub.add_parser("plan", help="what one weight sync costs (bytes full and delta, buckets, groups, memory, "
                                     "estimated time) from the model config alone; no weights are loaded")
    p.add_argument("items", nargs="+", metavar="JOB_OR_OVERRIDE")
    p.add_argument("--changed-fraction", type=_fraction, default=0.02,
                   help="fraction of elements a step changes, for the delta estimate (default 0.02)")
    p.add_argument("--nvlink-gbps", type=_positive, default=450.0, help="NVLink bandwidth, GB/s (default 450)")
    p.add_argument("--ib-gbps", type=_positive, default=50.0, help="InfiniBand bandwidth per rank, GB/s (default 50)")
    p.add_argument("--pcie-gbps", type=_positive, default=64.0, help="PCIe bandwidth, GB/s (default 64)")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("preflight", help="bring the job's platform up on its real layout and run one forward/backward "
                                         "(run under torchrun or srun with the job's world size)")
    _job_items(p)
    p.set_defaults(func=cmd_preflight)
    p = sub.add_parser("train", help="run a job (under torchrun or srun with the job's world size; a 1-rank job "
                                     "also runs as a plain process); resumes from its latest checkpoint")
    _job_items(p)
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("sft", help="supervised fine-tuning of a job with an [sft] section (under torchrun or srun; "
                                   "a 1-rank job also runs as a plain process); resumes from its latest checkpoint")
    _job_items(p)
    p.set_defaults(func=cmd_sft)
    p = sub.add_parser("eval", help="validate a checkpoint as training does (val/* metrics on the job's validation "
                                    "set) in one process",
                       description="Evaluate a checkpoint on the job's validation set with the validation sampling "
                                   "settings and rewards, reporting the val/* metrics the training loop logs. The "
                                   "checkpoint is the run's latest, or --step N; a job with no checkpoint yet is "
                                   "evaluated from its model.path.")
    _checkpoint_target_arguments(p)
    p.add_argument("--json", metavar="PATH", help="also write the metrics and sample rows here as JSON")
    p.add_argument("--force", action="store_true", help="replace an existing --json file")
    p.set_defaults(func=cmd_eval)
    p = sub.add_parser("generate", help="responses of a checkpoint's policy to prompts, through the job's rollout "
                                        "engine, as JSONL",
                       description="Generate responses with a checkpoint's weights (the latest, or --step N; the "
                                   "job's model.path when none) through the job's rollout engine, rendering prompts "
                                   "with the job's chat settings and sampling as training samples (rollout.*), one "
                                   "response per prompt. Prompts come from --prompt, --prompts or, by default, the "
                                   "job's data (--from-data N: its first N prompts, with their answers); responses "
                                   "to prompts with answers get the job's reward as their score.")
    _checkpoint_target_arguments(p)
    p.add_argument("--prompt", metavar="TEXT", help="one prompt")
    p.add_argument("--prompts", metavar="FILE.jsonl",
                   help="prompts, one a line: a JSON string or {\"prompt\": text or chat messages, \"answer\": ..., "
                        "\"data_source\": ...} (rows with answers are scored)")
    p.add_argument("--from-data", type=int, nargs="?", const=DATA_PROMPTS, default=None, metavar="N",
                   help=f"the first N prompts of the job's data (default {DATA_PROMPTS}; also what runs when no "
                        "prompt is given)")
    p.add_argument("--split", choices=("train", "val"), default=None,
                   help="which data --from-data reads (default: val when the job has validation data, else train)")
    p.add_argument("--no-score", action="store_true", help="do not score the responses with the job's reward")
    p.add_argument("--out", metavar="FILE.jsonl|FILE.parquet",
                   help="write the responses here, as JSONL or parquet by the suffix (default: JSONL on standard "
                        "output)")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    p.add_argument("-n", type=int, default=None, help="responses per prompt (default 1)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (0: greedy; default: "
                                                                    "rollout.temperature)")
    p.add_argument("--max-tokens", type=int, default=None, help="longest response in tokens "
                                                                 "(default: rollout.max_response_tokens)")
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("compare", help="MLflow runs side by side: spec differences, final/best metrics, PNG plots")
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="a run directory (<job.output_dir>/<job.name>, its mlflow.db) or .db file, or a run id, "
                        "run name or experiment name")
    p.add_argument("--tracking-uri", action="append", metavar="URI",
                   help="where to look up ids and names: an MLflow URI, a run directory or a .db file (repeatable; "
                        "default: $MLFLOW_TRACKING_URI, else every runs/*/mlflow.db)")
    p.add_argument("--metrics", metavar="LIST",
                   help="comma-separated groups (reward, kl, entropy, length, mismatch, time; default: all) "
                        "and/or metric keys or globs (actor/grad_norm, reward/score/*)")
    p.add_argument("--out", metavar="DIR", default="compare", help="directory for the PNG plots (default: compare)")
    p.set_defaults(func=cmd_compare)
    p = sub.add_parser("track", help="tracking upkeep: `mrl track replay RUN_DIR` writes the MLflow writes a run "
                                     "dropped (its store was locked, read-only or down) from RUN_DIR/tracking_dropped.jsonl")
    p.add_argument("action", choices=("replay",), help="replay: write the dropped writes into the store")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (<job.output_dir>/<job.name>)")
    p.add_argument("--tracking-uri", metavar="URI", default=None,
                   help="write to this MLflow store instead of the one each record names")
    p.set_defaults(func=cmd_track)
    p = sub.add_parser("launch", help="run a one-machine job under torchrun with the job's platform.ranks_per_node "
                                      "(multi-node jobs: launch/slurm.sh)")
    _job_items(p)
    p.add_argument("--run", metavar="CMD", help="the mrl subcommand each rank runs: train, preflight or validate "
                                                "(default: $MRL_COMMAND, else train)")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command instead of running it")
    p.set_defaults(func=cmd_launch)
    p = sub.add_parser("keys", help="list every job-spec key with its type, default and meaning")
    p.add_argument("prefix", nargs="?", default="", help="only keys starting with this (e.g. rollout.)")
    p.add_argument("--json", action="store_true", help="a JSON list of {key, type, required, default, meaning}")
    p.add_argument("--verl", action="store_true", help="list verl's keys instead: each with its mrl key and value "
                                                      "translation, or why mrl has none (the table mrl convert uses)")
    p.set_defaults(func=cmd_keys)
    p = sub.add_parser("convert", help="turn a verl config (Hydra YAML, a main_ppo command line or script, or both) "
                                       "into one commented mrl job, and validate it",
                       description="Turn a verl main_ppo configuration into one commented mrl TOML job: YAML files "
                                   "first, then Hydra overrides (key=value, +key=value, ++key=value, ~key) given here "
                                   "or read from a shell script (.sh) that runs verl.trainer.main_ppo. Every verl key "
                                   "is mapped (values translated) or listed in a comment with the reason it has no "
                                   "mrl counterpart. Exits 2 naming the values still to supply when the job does "
                                   "not validate yet.")
    p.add_argument("items", nargs="+", metavar="YAML|SCRIPT|key=value", help="verl YAML files, a .sh script, overrides")
    p.add_argument("-o", "--out", metavar="JOB.toml", help="write the job here (default: standard output)")
    p.add_argument("--force", action="store_true", help="replace an existing -o file")
    p.add_argument("--all", action="store_true", help="also list the dropped keys (verl's defaults) as comments")
    p.set_defaults(func=cmd_convert)
    p = sub.add_parser("data", help="write verl-format parquet (prompt messages, data_source, reward_model.ground_truth, "
                                    "extra_info) from a local dataset or a reasoning-gym task")
    data = p.add_subparsers(dest="kind", required=True)
    for kind, what in (("gsm8k", "GSM8K-shaped (question, answer with '#### n')"),
                       ("math", "MATH-shaped (problem, solution with a boxed answer)")):
        q = data.add_parser(kind, help=f"{what}: a local Hugging Face dataset directory or a parquet/jsonl/arrow file")
        q.add_argument("source", metavar="SRC", help="dataset directory (save_to_disk or hub layout) or data file")
        q.add_argument("out", metavar="OUT", help="output directory: one <split>.parquet per split")
        q.add_argument("--split", action="append", default=[], help="only this split (repeatable; default: every split)")
        q.add_argument("--subset", help="only files under a directory of this name (a hub config; gsm8k: main)")
        q.add_argument("--data-source", help="the rows' data_source (default: verl's name, which reward.builtin = "
                                             "'auto' routes to verl's scorer)")
        q.add_argument("--force", action="store_true", help="replace existing <split>.parquet files in OUT")
        q.set_defaults(func=cmd_data)
    q = data.add_parser("gym", help="rows of a reasoning-gym task (data_source reasoning_gym/<task>)")
    q.add_argument("task", help="reasoning-gym task, e.g. chain_sum")
    q.add_argument("out", metavar="OUT", help="output directory: train.parquet and test.parquet")
    q.add_argument("--train-size", type=_count, default=10000, help="training rows (default 10000; 0: none)")
    q.add_argument("--test-size", type=_count, default=500, help="test rows, from another seed (default 500; 0: none)")
    q.add_argument("--force", action="store_true", help="replace existing train/test.parquet files in OUT")
    q.add_argument("--seed", type=int, default=0, help="train rows use SEED, test rows SEED + 1 (default 0)")
    q.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="task option (repeatable; VALUE read as TOML, e.g. min_terms=2)")
    q.add_argument("--system-prompt", default="default",
                   help="reasoning-gym system prompt name, or 'none' (default: default)")
    q.set_defaults(func=cmd_data)
    p = sub.add_parser("merge", help="convert a training checkpoint (any TP/PP/EP) into a Hugging Face directory",
                       description="Convert a training checkpoint (any TP/PP/EP) into a Hugging Face model directory; "
                                   "a LoRA checkpoint's adapters are merged into full weights (W + alpha/r BA), or with "
                                   "--format peft written as a PEFT adapter directory (adapter_config.json + "
                                   "adapter_model.safetensors) that peft.PeftModel.from_pretrained loads over the base "
                                   "model.")
    p.add_argument("checkpoint", metavar="CKPT", help="a run directory (its checkpoints/actor), a checkpoint root (e.g. RUN/checkpoints/actor) or a step_* directory")
    p.add_argument("out", metavar="OUT", help="output directory (must not exist, or be empty)")
    p.add_argument("--max-shard-size", default="2GB", help="largest safetensors shard, e.g. 2GB, 500MB (default 2GB)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="dtype of the written weights (default: the checkpoint's)")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None,
                   help="reload the output with transformers and compare logits with the checkpoint's model "
                        "(default: on below 2B parameters)")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="the job's model.path, for checkpoints that do not record their model config")
    p.add_argument("--format", choices=("hf", "peft"), default="hf",
                   help="hf: full Hugging Face weights, LoRA adapters merged in (default); peft: a LoRA "
                        "checkpoint's adapters as a PEFT adapter directory over the job's base model")
    p.set_defaults(func=cmd_merge)
    for name, command in sub.choices.items():   # every subcommand's --help: what it does, and examples
        if not command.description:
            help_text = next(a.help for a in sub._choices_actions if a.dest == name)
            command.description = help_text[0].upper() + help_text[1:] + "."
        command.epilog = "Examples:\n" + "\n".join(f"  {line}" for line in EXAMPLES[name])
        command.formatter_class = _HelpFormatter
    return parser


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's help, with the lines of an "Examples:" epilog kept as written (not re-wrapped)."""

    def _fill_text(self, text, width, indent):
        if text.startswith("Examples:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


# shown under each subcommand's --help (a test runs every command's --help and checks each has some)
EXAMPLES: dict[str, tuple[str, ...]] = {
    "validate": ("mrl validate jobs/quickstart_cpu.toml",
                 "mrl validate my_job.toml actor.optim.lr=2e-6 'data.train_files=[a.parquet, b.parquet]'"),
    "show": ("mrl show jobs/quickstart_cpu.toml                 # the whole resolved job as TOML",
             "mrl show jobs/quickstart_cpu.toml --get platform.world_size --get tracking.backends"),
    "plan": ("mrl plan jobs/grpo_qwen2.5_7b.toml",
             "mrl plan jobs/grpo_qwen2.5_7b.toml --changed-fraction 0.05 --ib-gbps 25"),
    "preflight": ("MRL_COMMAND=preflight launch/torchrun.sh jobs/grpo_qwen2.5_7b.toml",
                  "torchrun --nproc_per_node 8 -m mrl preflight jobs/grpo_qwen2.5_7b.toml"),
    "train": ("launch/torchrun.sh jobs/quickstart_cpu.toml       # one node, ranks from the job",
              "torchrun --nproc_per_node 2 -m mrl train jobs/quickstart_cpu.toml trainer.total_steps=80",
              "mrl train jobs/quickstart_cpu.toml platform.ranks_per_node=1 parallel.tensor=1   # one process"),
    "sft": ("mrl launch jobs/sft_cpu.toml",
            "torchrun --nproc_per_node 2 -m mrl sft jobs/sft_cpu.toml sft.lora.rank=8"),
    "eval": ("mrl eval runs/quickstart-cpu                      # the run's latest checkpoint",
             "mrl eval jobs/quickstart_cpu.toml --step 20 --json val.json"),
    "generate": ("mrl generate runs/quickstart-cpu --prompt 'Write 12 in digits:' -n 4",
                 "mrl generate runs/quickstart-cpu --from-data 64 --out samples.parquet",
                 "mrl generate jobs/quickstart_cpu.toml --prompts prompts.jsonl --temperature 0"),
    "compare": ("mrl compare runs/quickstart-cpu runs/quickstart-cpu-lr1e-3",
                "mrl compare runs/quickstart-cpu --metrics reward,kl --out plots"),
    "track": ("mrl track replay runs/quickstart-cpu",),
    "launch": ("mrl launch jobs/quickstart_cpu.toml",
               "mrl launch jobs/quickstart_cpu.toml --run preflight --dry-run"),
    "keys": ("mrl keys rollout.", "mrl keys --verl actor_rollout_ref.rollout", "mrl keys --json > keys.json"),
    "convert": ("mrl convert verl_ppo.yaml -o job.toml",
                "mrl convert run_qwen2-7b_grpo.sh actor_rollout_ref.rollout.n=8 -o job.toml"),
    "data": ("mrl data gsm8k ~/datasets/gsm8k data/gsm8k",
             "mrl data gym chain_sum data/chain_sum --train-size 2000 --option min_terms=2"),
    "merge": ("mrl merge runs/quickstart-cpu runs/quickstart-cpu/hf",
              "mrl merge runs/my-lora-run out --format peft --dtype bfloat16"),
}


REPORT_GRACE_S = 3.0   # how long a failing rank waits to learn whether a lower rank failed too


def _error_store():
    """The launcher's key-value store, reachable without a working process group: the one mrl's
    platform set up, else torchrun's agent store; None when neither is there."""
    import datetime
    import os

    from mrl.platform import dist as mrl_dist

    store = getattr(mrl_dist._STATE, "base_store", None)
    if store is not None:
        return store
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and os.environ.get("MASTER_ADDR"):
        import torch.distributed as dist

        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=datetime.timedelta(seconds=REPORT_GRACE_S), multi_tenant=True)
    return None


def _first_to_report() -> bool:
    """Whether this rank prints a user error: always in a one-rank run; under torchrun/srun only the
    lowest failing rank does (each failing rank marks itself in the launcher's store, then stays
    quiet if a lower rank is marked within REPORT_GRACE_S). Without a store every rank prints."""
    import os
    import time

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world <= 1:
        return True
    try:
        store = _error_store()
        if store is None:
            return True
        store.set(f"mrl/user_error/{rank}", "1")
        lower = [f"mrl/user_error/{r}" for r in range(rank)]
        deadline = time.monotonic() + REPORT_GRACE_S
        while lower:
            if any(store.check([k]) for k in lower):
                return False
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return True
    except Exception:   # the store is gone (its host rank exited): better twice than never
        return True


def main(argv: list[str] | None = None) -> int:
    from mrl.platform.quiet import quiet_known_warnings

    quiet_known_warnings()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command in ("eval", "generate") and all("=" in a and not a.startswith("-") for a in extra):
        args.items, extra = [*args.items, *extra], []   # overrides after the options
    if extra:   # only `mrl convert` passes verl's own flags on (a pasted `python3 -m verl.trainer.main_ppo ...`)
        if args.command != "convert":
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.items = [*args.items, *extra]
    try:
        return args.func(args)
    except UserError as e:
        if _first_to_report():
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
