"""Fault battery, stages and timeouts on 2 ranks: a slow but correct reward trains (the waiting
rank waits in a stage whose timeout covers the rewards' own bound); a hung collective names its
stage."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.dist_util import run_torchrun


@pytest.fixture(scope="module")
def scored_past_the_timeout(tmp_path_factory) -> Path:
    """Two 2-rank quickstart runs whose leader scores for longer than the waiting rank's collective
    timeout, in one launch (`run_jobs.py`: one `train()` after the other): `slow`, a correct reward
    of one second per call under a 30 s timeout; `hangs`, a reward that always hangs, killed at 2 s,
    under a 10 s timeout."""
    out = tmp_path_factory.mktemp("scored")
    run_torchrun("tests/train/scripts/run_jobs.py", "jobs/quickstart_cpu.toml", str(out),
                 # quickstart: TP=2, 8 prompts x 8 responses on the leader, 2 reward workers: ~32 s of
                 # scoring per step while rank 1 waits, longer than platform.collective_timeout_s = 30
                 "platform.collective_timeout_s=30 reward.function=tests/faults/slow_reward.py:score "
                 "trainer.total_steps=1 checkpoint.every_steps=0 tracking.backends=[\"console\"] "
                 f"job.output_dir={out / 'slow'} job.name=slow",
                 # 4 prompts x 4 responses, every call killed at 2 s on 2 workers: ~16 s of scoring on
                 # the leader, longer than the 10 s collective timeout rank 1 would otherwise wait in
                 "platform.collective_timeout_s=10 reward.function=tests/reward/user_rewards.py:hangs "
                 "reward.timeout_s=2 reward.workers=2 data.prompts_per_step=4 rollout.responses_per_prompt=4 "
                 "trainer.total_steps=1 checkpoint.every_steps=0 tracking.backends=[\"mlflow\"] "
                 f"job.output_dir={out / 'hangs'} job.name=hangs", timeout=900)
    return out


@pytest.mark.slow
def test_one_second_per_call_reward_trains_with_a_30s_collective_timeout(scored_past_the_timeout):
    assert (scored_past_the_timeout / "slow/slow/checkpoints/actor/step_00000001/manifest.json").is_file()


STOPPED_CASES = ("checkpoint_save", "checkpoint_load", "metrics_all_gather", "rollout_generation", "reward_scoring")


@pytest.mark.slow
def test_a_stopped_rank_is_named_by_stage_on_the_survivor(tmp_path):
    proc = run_torchrun(Path(__file__).parent / "scripts" / "stage_faults.py", str(tmp_path), nproc=2, timeout=300)
    got = {m.group(1): (m.group(2), m.group(3)) for m in
           re.finditer(r"^FAULT stopped_rank_in_(\S+) (handled|lost) (.*)$", proc.stdout, re.M)}
    assert set(got) == set(STOPPED_CASES), proc.stdout
    assert all(v[0] == "handled" for v in got.values()), got
    for name, (_, line) in got.items():
        print(f"{name}: {line}")


@pytest.mark.slow
def test_an_always_hanging_reward_is_counted_and_the_step_finishes(scored_past_the_timeout):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{scored_past_the_timeout / 'hangs' / 'mlflow.db'}")
    [run] = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    m = run.data.metrics
    timeouts = {k: v for k, v in m.items() if k.endswith("/errors/timeout")}
    assert m["reward/errors"] == 16 and list(timeouts.values()) == [16.0], m
    assert run.info.status == "FINISHED"
