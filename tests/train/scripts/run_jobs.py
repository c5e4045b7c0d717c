"""Run one job several times in this process, each with its own overrides (one `train()` each, or
one `sft()` for an SFT job). An override set whose first word is a `.toml` file runs that job
instead of JOB (several jobs, one launch).

    python run_jobs.py JOB OUT_DIR 'key=value key=value' ['other.toml key=value ...' ...]

Prints one `RESULT <index> <json metrics of the last step>` line per run; every run writes under
OUT_DIR/run<index>.
"""
from __future__ import annotations

import sys

from tests.dist_util import print_result


def main() -> None:
    from mrl.config.loader import load
    from mrl.sft.loop import sft
    from mrl.train.loop import train

    job, out = sys.argv[1], sys.argv[2]
    for i, overrides in enumerate(sys.argv[3:]):
        words = overrides.split()
        this_job = words.pop(0) if words and words[0].endswith(".toml") else job
        spec, _ = load(this_job, [f"job.output_dir={out}", f"job.name=run{i}", *words])
        metrics = sft(spec) if hasattr(spec, "sft") else train(spec)
        print_result(i, metrics)


if __name__ == "__main__":
    main()
