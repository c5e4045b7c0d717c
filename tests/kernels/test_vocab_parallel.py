"""Vocab-parallel log-prob/entropy and fused linear path over 2 gloo ranks vs. one rank."""
import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, home of dist_util
from dist_util import run_torchrun  # noqa: E402

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
