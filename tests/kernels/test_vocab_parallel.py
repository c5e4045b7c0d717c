"""Vocab-parallel log-prob/entropy and fused linear path over 2 gloo ranks vs. one rank."""
import importlib.util
from pathlib import Path

import pytest

# Never put tests/ itself on sys.path: tests/platform would shadow the stdlib `platform` in every
# process spawned afterwards (reward and tool workers).
from tests.dist_util import run_torchrun

WORKER = Path(__file__).with_name("vp_worker.py")


@pytest.mark.slow
def test_vocab_parallel_twin_two_ranks():
    proc = run_torchrun(WORKER, nproc=2, timeout=240, env={"MRL_KERNELS_BACKEND": "torch"})
    assert proc.stdout.count("vocab-parallel OK") == 2, proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_vocab_parallel_triton_interpreter_two_ranks():
    proc = run_torchrun(WORKER, nproc=2, timeout=240,
                        env={"MRL_KERNELS_BACKEND": "triton", "TRITON_INTERPRET": "1"})
    assert proc.stdout.count("vocab-parallel OK") == 2, proc.stdout
