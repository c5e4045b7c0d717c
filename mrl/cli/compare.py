"""`mrl compare`: MLflow runs side by side."""
from __future__ import annotations



def cmd_compare(args) -> int:
    from mrl.compare import compare
    from mrl.outputs import check_output

    if args.out:   # a directory of PNG plots: not a file, not inside a checkpoint
        check_output(args.out, what="mrl compare --out", kind="dir")
    compare(args.runs, tracking_uris=args.tracking_uri or (), metrics=args.metrics, out=args.out)
    return 0


def add(sub) -> None:
    """The parser of `mrl compare`."""
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


EXAMPLES: dict[str, tuple[str, ...]] = {   # under each command's --help
    "compare": ("mrl compare runs/quickstart-cpu runs/quickstart-cpu-lr1e-3",
                "mrl compare runs/quickstart-cpu --metrics reward,kl --out plots"),
}
