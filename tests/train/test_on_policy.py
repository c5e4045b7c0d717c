"""An on-policy step (`mrl.train.plan.on_policy`) takes its old log-probs and the audit from the
actor update's own forward pass: one forward pass fewer, the same losses and metrics."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.dist_util import REPO

SCRIPT = REPO / "tests/train/scripts/on_policy_steps.py"


def test_the_plan_says_when_a_step_is_on_policy():
    from mrl.config.loader import load
    from mrl.train.plan import step_plan

    one = ["platform.ranks_per_node=1", "parallel.tensor=1", "actor.mini_batch_prompts=8"]
    assert step_plan(load("jobs/quickstart_cpu.toml", one)[0]).on_policy
    assert not step_plan(load("jobs/quickstart_cpu.toml")[0]).on_policy            # 2 mini-batches
    for patch in (["actor.epochs=2"], ["algorithm.kl_reward.enable=true"], ["algorithm.correction.level=token"],
                  ["actor.shuffle=true"]):
        assert not step_plan(load("jobs/quickstart_cpu.toml", one + patch)[0]).on_policy, patch


@pytest.mark.slow
def test_on_policy_step_skips_the_old_logprob_pass_with_identical_metrics():
    """Two steps of the 1-rank quickstart with one mini-batch, twice in one process: with the
    separate old-log-prob pass and without it. Every loss, audit and reward metric is equal."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "jobs/quickstart_cpu.toml", "2", "platform.ranks_per_node=1",
                           "parallel.tensor=1", "actor.mini_batch_prompts=8", "tracking.backends=[]"],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {line.split()[1]: json.loads(line.split(" ", 2)[2]) for line in proc.stdout.splitlines()
            if line.startswith("RESULT ")}
    separate, reuse = runs["separate"], runs["reuse"]
    assert len(separate) == len(reuse) == 2
    for a, b in zip(separate, reuse):
        assert "time/old_logprobs" in a and "time/old_logprobs" not in b
        keys = [k for k in a if not k.startswith(("time/", "memory/"))]
        assert "rollout/logprob_abs_diff_mean" in keys and "actor/pg_loss" in keys
        assert {k: b.get(k) for k in keys} == {k: a[k] for k in keys}
