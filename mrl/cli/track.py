"""`mrl track replay`: write the MLflow writes a run dropped."""
from __future__ import annotations



def cmd_track(args) -> int:
    """`mrl track replay RUN_DIR`: write the tracker writes a run dropped into its MLflow store."""
    import logging

    from mrl.tracking.journal import replay

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    report = replay(args.run_dir, tracking_uri=args.tracking_uri)
    print(report.summary())
    return 1 if report.failed else 0


def add(sub) -> None:
    """The parser of `mrl track`."""
    p = sub.add_parser("track", help="tracking upkeep: `mrl track replay RUN_DIR` writes the MLflow writes a run "
                                     "dropped (its store was locked, read-only or down) from RUN_DIR/tracking_dropped.jsonl")
    p.add_argument("action", choices=("replay",), help="replay: write the dropped writes into the store")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (<job.output_dir>/<job.name>)")
    p.add_argument("--tracking-uri", metavar="URI", default=None,
                   help="write to this MLflow store instead of the one each record names")
    p.set_defaults(func=cmd_track)


EXAMPLES: dict[str, tuple[str, ...]] = {   # under each command's --help
    "track": ("mrl track replay runs/quickstart-cpu",),
}
