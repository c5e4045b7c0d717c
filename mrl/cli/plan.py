"""`mrl plan`: what one weight sync of a job costs, from the model config alone."""
from __future__ import annotations

from mrl.cli.common import fraction, one_job, positive, split_args


def cmd_plan(args) -> int:
    """The weight sync's bytes, buckets, groups, memory and estimated time, from the model config only."""
    from mrl.weights.sync_plan import Links, plan_text

    jobs, _ = split_args(args.items)
    spec = one_job(args, "plan")
    links = Links(nvlink_gbps=args.nvlink_gbps, ib_gbps=args.ib_gbps, pcie_gbps=args.pcie_gbps)
    print(plan_text(spec, jobs[0], links, args.changed_fraction))
    return 0


def add(sub) -> None:
    """The parser of `mrl plan`."""
    p = sub.add_parser("plan", help="what one weight sync costs (bytes full and delta, buckets, groups, memory, "
                                     "estimated time) from the model config alone; no weights are loaded")
    p.add_argument("items", nargs="+", metavar="JOB_OR_OVERRIDE")
    p.add_argument("--changed-fraction", type=fraction, default=0.02,
                   help="fraction of elements a step changes, for the delta estimate (default 0.02)")
    p.add_argument("--nvlink-gbps", type=positive, default=450.0, help="NVLink bandwidth, GB/s (default 450)")
    p.add_argument("--ib-gbps", type=positive, default=50.0, help="InfiniBand bandwidth per rank, GB/s (default 50)")
    p.add_argument("--pcie-gbps", type=positive, default=64.0, help="PCIe bandwidth, GB/s (default 64)")
    p.set_defaults(func=cmd_plan)


EXAMPLES: dict[str, tuple[str, ...]] = {   # under each command's --help
    "plan": ("mrl plan jobs/grpo_qwen2.5_7b.toml",
             "mrl plan jobs/grpo_qwen2.5_7b.toml --changed-fraction 0.05 --ib-gbps 25"),
}
