"""`mrl data`: verl-format parquet from a local dataset (gsm8k, math, geo3k) or a reasoning-gym task."""
from __future__ import annotations

from mrl.cli.common import count
from mrl.errors import UserError


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


def add(sub) -> None:
    """The parser of `mrl data`."""
    p = sub.add_parser("data", help="write verl-format parquet (prompt messages, data_source, reward_model.ground_truth, "
                                    "extra_info) from a local dataset or a reasoning-gym task")
    data = p.add_subparsers(dest="kind", required=True)
    for kind, what in (("gsm8k", "GSM8K-shaped (question, answer with '#### n')"),
                       ("math", "MATH-shaped (problem, solution with a boxed answer)"),
                       ("geo3k", "geometry3k (problem with <image> marks, answer, images) for vision-language models")):
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
    q.add_argument("--train-size", type=count, default=10000, help="training rows (default 10000; 0: none)")
    q.add_argument("--test-size", type=count, default=500, help="test rows, from another seed (default 500; 0: none)")
    q.add_argument("--force", action="store_true", help="replace existing train/test.parquet files in OUT")
    q.add_argument("--seed", type=int, default=0, help="train rows use SEED, test rows SEED + 1 (default 0)")
    q.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="task option (repeatable; VALUE read as TOML, e.g. min_terms=2)")
    q.add_argument("--system-prompt", default="default",
                   help="reasoning-gym system prompt name, or 'none' (default: default)")
    q.set_defaults(func=cmd_data)


EXAMPLES: dict[str, tuple[str, ...]] = {   # under each command's --help
    "data": ("mrl data gsm8k ~/datasets/gsm8k data/gsm8k", "mrl data geo3k ~/datasets/geometry3k data/geo3k",
             "mrl data gym chain_sum data/chain_sum --train-size 2000 --option min_terms=2"),
}
