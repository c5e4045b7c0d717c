"""`mrl eval` and `mrl generate`: a checkpoint validated, or its responses to prompts, in one process."""
from __future__ import annotations

import argparse

from mrl.errors import UserError


def _target(args, command: str):
    """The job and checkpoint `mrl eval` / `mrl generate` use (`mrl.offline.target`)."""
    from mrl.offline.target import resolve

    sources = [a for a in args.items if "=" not in a]
    if len(sources) != 1:
        raise UserError(f"mrl {command} takes one job file or run directory, got {len(sources)}: {' '.join(sources)}")
    return resolve(sources[0], [a for a in args.items if "=" in a], args.step, command)


def _checkpoint_target_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments `mrl eval` and `mrl generate` share: what to load (`mrl.offline.target`)."""
    p.add_argument("items", nargs="+", metavar="JOB|RUN_DIR|key=value",
                   help="a job file or a run directory (<job.output_dir>/<job.name>), and dotted overrides")
    p.add_argument("--step", type=int, default=None, metavar="N", help="the checkpoint of step N (default: the latest)")


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


def add(sub) -> None:
    """The parsers of `mrl eval`, `mrl generate`."""
    from mrl.offline.generate import DATA_PROMPTS

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


EXAMPLES: dict[str, tuple[str, ...]] = {   # under each command's --help
    "eval": ("mrl eval runs/quickstart-cpu                      # the run's latest checkpoint",
             "mrl eval jobs/quickstart_cpu.toml --step 20 --json val.json"),
    "generate": ("mrl generate runs/quickstart-cpu --prompt 'Write 12 in digits:' -n 4",
                 "mrl generate runs/quickstart-cpu --from-data 64 --out samples.parquet",
                 "mrl generate jobs/quickstart_cpu.toml --prompts prompts.jsonl --temperature 0"),
}
