"""Smoke test of tools/bench/kernels.py on CPU with tiny shapes (it must run and agree)."""
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_benchmark_runs_on_cpu():
    env = {k: v for k, v in os.environ.items()
           if k not in ("MRL_KERNELS_BACKEND", "TRITON_INTERPRET")}
    proc = subprocess.run([sys.executable, str(REPO / "tools/bench/kernels.py"), "--n", "48",
                           "--v", "700", "--h", "16", "--iters", "1", "--warmup", "1",
                           "--device", "cpu"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    for needle in ("== logprob_entropy  N=48 V=700", "mrl (torch twin)", "torch eager",
                   "== linear -> logprob_entropy", "fused linear", "fwd+bwd peak memory: fused/eager"):
        assert needle in out, (needle, out)
    err = float(re.search(r"max \|mrl - eager\| \(logp, entropy; first 48 rows\): (\S+)", out).group(1))
    assert err < 1e-4, out
