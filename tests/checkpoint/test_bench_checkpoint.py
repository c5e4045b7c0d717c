"""Smoke test of tools/bench/checkpoint.py on a tiny model (it must run and print its table)."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_checkpoint_bench_runs_on_a_tiny_model():
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_PORT": "29547"}
    proc = subprocess.run([sys.executable, str(REPO / "tools/bench/checkpoint.py"), "--tiny", "--layers", "1",
                           "--saves", "1", "--profile", "3"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for needle in ("mrl save, sha256", "mrl save ", "torch.save", "mrl save / torch.save", "mrl save, torch_dist optim",
                   "mrl load ", "torch.load", "mrl load / torch.load",
                   "manifest hashing alone, sha256", "manifest hashing alone, xxh3_128", "cumulative"):
        assert needle in proc.stdout, (needle, proc.stdout)
