"""Train one job's first steps twice in this process, from the same start: once with the separate
old-log-prob forward pass, once taking the old log-probs and the audit from the actor update's
own forward (`train_step(on_policy=...)`), and print both runs' metrics.

    python on_policy_steps.py JOB STEPS [key=value ...]

Prints `RESULT <separate|reuse> <json list of per-step metrics>` per run.
"""
from __future__ import annotations

import sys

from tests.dist_util import print_result


def main() -> None:
    from mrl.config.loader import load
    from mrl.platform import teardown
    from mrl.train.build import build, close
    from mrl.train.colocated import ColocatedRollouts
    from mrl.train.step import train_step

    job, steps, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    spec, _ = load(job, overrides)
    for mode in ("separate", "reuse"):
        run, learner, gen, prompts = build(spec)
        assert run.plan.on_policy, "the job is not on-policy"
        rollouts = ColocatedRollouts(run, learner, gen, prompts)
        rollouts.start(0)
        out = []
        try:
            for step in range(1, steps + 1):
                out.append(train_step(run, learner, rollouts, step, on_policy=mode == "reuse"))
                rollouts.publish(step)
        finally:
            close(gen)
            teardown()
        print_result(mode, out)


if __name__ == "__main__":
    main()
