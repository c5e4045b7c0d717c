"""Fault battery, stages and timeouts on 2 ranks: a slow but correct reward trains (the waiting
rank waits in a stage whose timeout covers the rewards' own bound); a hung collective names its
stage."""
from __future__ import annotations

import pytest

from tests.dist_util import run_torchrun


@pytest.mark.slow
def test_one_second_per_call_reward_trains_with_a_30s_collective_timeout(tmp_path):
    # quickstart: TP=2, 8 prompts x 8 responses on the leader, 2 reward workers: ~32 s of scoring
    # per step while rank 1 waits, longer than platform.collective_timeout_s = 30
    proc = run_torchrun("-m mrl train", "jobs/quickstart_cpu.toml", "platform.collective_timeout_s=30",
                        "reward.function=tests/faults/slow_reward.py:score", "trainer.total_steps=2",
                        "checkpoint.every_steps=0", "tracking.backends=[\"console\"]", f"job.output_dir={tmp_path}",
                        "job.name=slow", timeout=500)
    assert (tmp_path / "slow/checkpoints/actor/step_00000002/manifest.json").is_file(), proc.stdout[-3000:]
