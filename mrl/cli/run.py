"""`mrl preflight`, `mrl train`, `mrl sft`: run a job on every rank (under torchrun or srun).

`train` and `sft` print their first line before torch is imported (`mrl.tracking.startup`)."""
from __future__ import annotations

from mrl.cli.common import job_items, one_job, split_args
from mrl.errors import UserError


def cmd_preflight(args) -> int:
    from mrl import preflight

    preflight.run(one_job(args, "preflight"))
    return 0


def cmd_train(args) -> int:
    from pathlib import Path

    from mrl.tracking.startup import STARTUP   # the first line, before torch is imported

    STARTUP.start()
    STARTUP.say(f"mrl train {' '.join(split_args(args.items)[0])}: checking the job")
    spec = one_job(args, "train")
    if hasattr(spec, "sft"):
        raise UserError(f"{split_args(args.items)[0][0]}: an SFT job (it has an [sft] section): run it with `mrl sft`")
    STARTUP.say(f"spec ok: run directory {(Path(spec.job.output_dir) / spec.job.name).resolve()}", timed=True)
    from mrl.train.loop import train

    train(spec)
    return 0


def cmd_sft(args) -> int:
    from pathlib import Path

    from mrl.tracking.startup import STARTUP   # the first line, before torch is imported

    STARTUP.start()   # the phases of `mrl train`, and weight-loading progress lines, on rank 0
    STARTUP.say(f"mrl sft {' '.join(split_args(args.items)[0])}: checking the job")
    spec = one_job(args, "sft")
    if not hasattr(spec, "sft"):
        raise UserError(f"{split_args(args.items)[0][0]}: not an SFT job (no [sft] section): RL jobs run with `mrl train`")
    STARTUP.say(f"spec ok: run directory {(Path(spec.job.output_dir) / spec.job.name).resolve()}", timed=True)
    from mrl.sft.loop import sft

    sft(spec)
    return 0


def add(sub) -> None:
    """The parsers of `mrl preflight`, `mrl train`, `mrl sft`."""
    p = sub.add_parser("preflight", help="bring the job's platform up on its real layout and run one forward/backward "
                                         "(run under torchrun or srun with the job's world size)")
    job_items(p)
    p.set_defaults(func=cmd_preflight)
    p = sub.add_parser("train", help="run a job (under torchrun or srun with the job's world size; a 1-rank job "
                                     "also runs as a plain process); resumes from its latest checkpoint")
    job_items(p)
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("sft", help="supervised fine-tuning of a job with an [sft] section (under torchrun or srun; "
                                   "a 1-rank job also runs as a plain process); resumes from its latest checkpoint")
    job_items(p)
    p.set_defaults(func=cmd_sft)


EXAMPLES: dict[str, tuple[str, ...]] = {   # under each command's --help
    "preflight": ("MRL_COMMAND=preflight launch/torchrun.sh jobs/grpo_qwen2.5_7b.toml",
                  "torchrun --nproc_per_node 8 -m mrl preflight jobs/grpo_qwen2.5_7b.toml"),
    "train": ("launch/torchrun.sh jobs/quickstart_cpu.toml       # one node, ranks from the job",
              "torchrun --nproc_per_node 2 -m mrl train jobs/quickstart_cpu.toml trainer.total_steps=80",
              "mrl train jobs/quickstart_cpu.toml platform.ranks_per_node=1 parallel.tensor=1   # one process"),
    "sft": ("mrl launch jobs/sft_cpu.toml",
            "torchrun --nproc_per_node 2 -m mrl sft jobs/sft_cpu.toml sft.lora.rank=8"),
}
