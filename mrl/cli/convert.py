"""`mrl convert`: a verl config (YAML, command line or script) -> one commented mrl job, validated."""
from __future__ import annotations

import sys

from mrl.cli.common import summary
from mrl.errors import UserError


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


def add(sub) -> None:
    """The parser of `mrl convert`."""
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


EXAMPLES: dict[str, tuple[str, ...]] = {   # under each command's --help
    "convert": ("mrl convert verl_ppo.yaml -o job.toml",
                "mrl convert run_qwen2-7b_grpo.sh actor_rollout_ref.rollout.n=8 -o job.toml"),
}
