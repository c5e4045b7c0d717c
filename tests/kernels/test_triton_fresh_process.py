"""Run test_logprob_triton.py in a fresh process when this one cannot use the interpreter.

That happens when something imported triton before tests/kernels/conftest.py set
TRITON_INTERPRET (e.g. a test module importing megatron.core or liger was collected first);
test_logprob_triton.py then skips itself and this test runs it where the interpreter works.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels_ref import interpreter_usable


@pytest.mark.skipif(interpreter_usable(), reason="the Triton tests run in this process")
def test_triton_suite_in_fresh_process():
    here = Path(__file__).parent
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", str(here / "test_logprob_triton.py"), "-q",
                           "-p", "no:cacheprovider", "-m", "not slow"],
                          cwd=here.parents[1], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
