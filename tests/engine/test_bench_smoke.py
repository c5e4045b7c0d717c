"""`tools/bench/train_step.py` runs at toy size on cpu and prints its step-time breakdown."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.dist_util import REPO, free_port

pytestmark = pytest.mark.slow


def test_train_step_benchmark_runs_and_prints_its_breakdown():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "bench" / "train_step.py"), "--device", "cpu",
                           "--steps", "1", "--responses", "8", "--prompt-len", "16", "--response-len", "32",
                           "--micro-batch-tokens", "200"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    head = re.search(r"^train_step: cpu, tiny \([\d.]+M params, float32, attention sdpa, recompute none\), "
                     r"8 responses, (\d+) tokens/step, (\d+) micro-batch", out, re.M)
    assert head, out
    assert int(head.group(2)) >= 2, out  # the budget forces several packed micro-batches
    assert re.search(r"^  step [\d.]+ ms  ->  [\d,]+ tokens/s$", out, re.M), out
    shares = re.search(r"packing\s+([\d.]+)%\s+loss callback \(incl. log-prob kernel\)\s+([\d.]+)%\s+"
                       r"optimizer step\s+([\d.]+)%\s+model forward/backward\s+([\d.]+)%", out)
    assert shares, out
    assert abs(sum(float(x) for x in shares.groups()) - 100.0) < 0.1, shares.groups()
    assert re.search(r"^  peak memory [\d.]+ GiB \(host RSS\)$", out, re.M), out


def test_rope_benchmark_runs_and_prints_its_ratios():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "bench" / "rope.py"), "--device", "cpu",
                           "--tokens", "256", "--sequences", "16", "--heads", "2", "--head-dim", "16",
                           "--iters", "2", "--warmup", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    head = re.search(r"^rope: cpu, float32, 256 tokens in 16 sequences .* max \|mrl - megatron\| (\S+)$", out, re.M)
    assert head and float(head.group(1)) == 0.0, out  # the same roundings as megatron's path
    for name in ("megatron per-sequence thd", "mrl \\+tables", "mrl rotate"):
        assert re.search(rf"^  {name}\s+[\d.]+ ms\s+[\d.]+x$", out, re.M), out
    assert re.search(r"^  ratio megatron / mrl: [\d.]+x with tables per layer, [\d.]+x per layer after the first$",
                     out, re.M), out
