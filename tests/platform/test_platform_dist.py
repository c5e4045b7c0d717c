"""Slow tier of the platform layer: 2-rank torchrun (gloo) runs of megatron-core on the cpu platform.

Each script asserts its own comparisons (max abs difference <= 1e-5) and prints `MAXDIFF name
value` lines; these tests re-check the printed values so a script that silently skipped a
comparison fails too.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.dist_util import run_torchrun

SCRIPTS = Path(__file__).parent / "scripts"
TOL = 1e-5

pytestmark = pytest.mark.slow


def _maxdiffs(stdout: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^MAXDIFF (\S+) (\S+)$", stdout, re.M)}


def _run(script: str, *args: str, expect: set[str], tol: float = TOL, timeout: float = 240) -> dict[str, float]:
    proc = run_torchrun(SCRIPTS / script, *args, nproc=2, timeout=timeout)
    diffs = _maxdiffs(proc.stdout)
    assert set(diffs) == expect, f"expected reports {sorted(expect)}, got {diffs}\n{proc.stdout}"
    for name, value in diffs.items():
        assert value <= tol, f"{name}: {value:g} > {tol:g}"
    print(diffs)
    return diffs


# what each check of `equivalences.py` reports (its script alone reports the same)
REPORTS = {
    "tp_equivalence.py": {"tp_logits", "tp_loss", "tp_grads", "tp_recompute_grads"},
    "pp_equivalence.py": {"pp_loss", "pp_grads", "pp_tied_embedding"},
    "ep_equivalence.py": {"ep_logits", "ep_loss", "ep_grads"},
    "optim_equivalence.py": {"optim_grad_norm", "optim_params_after_step", "optim_plain_vs_distributed"},
    "ckpt_roundtrip.py": {"ckpt_weights_tp2_to_tp1", "ckpt_logits_tp2_vs_tp1"},
}


def test_layouts_match_and_a_tp2_checkpoint_loads_at_tp1(tmp_path):
    """One 2-rank launch (`equivalences.py`), each check bringing the platform up and down: TP2
    matches TP1 (logits, loss, grads, recompute grads); PP2 matches PP1 with megatron's pipeline
    schedule (tied embedding too); MoE EP2 alltoall matches EP1; the DDP + distributed optimizer
    step matches across layouts; a dist checkpoint saved at TP2 loads at TP1, weights exactly."""
    (tmp_path / "ckpt").mkdir()  # dist_checkpointing.save wants an existing, empty directory
    diffs = _run("equivalences.py", str(tmp_path / "ckpt"), expect=set().union(*REPORTS.values()), timeout=600)
    assert diffs["ckpt_weights_tp2_to_tp1"] == 0.0
    assert (tmp_path / "ckpt" / "metadata.json").exists()


def test_skipped_collective_becomes_collective_timeout_naming_the_stage():
    timeout = 3.0
    proc = run_torchrun(SCRIPTS / "collective_timeout.py", str(timeout), nproc=2, timeout=120)
    m = re.search(r"^TIMEOUT_OK (\S+) (.*)$", proc.stdout, re.M)
    assert m, proc.stdout
    elapsed, msg = float(m.group(1)), m.group(2)
    assert timeout * 0.9 <= elapsed < timeout + 5
    assert msg.startswith("collective in stage 'weight sync' did not finish within 3 s (rank 0/2")
