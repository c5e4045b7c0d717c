"""Backend selection, the env override, and importing mrl_kernels without triton."""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from mrl_kernels import _dispatch


def _tensor(cuda: bool, dtype=torch.float32):
    return SimpleNamespace(is_cuda=cuda, dtype=dtype)


def test_auto_selects_by_device(monkeypatch):
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    assert _dispatch.select_backend(torch.zeros(1)) == "torch"
    monkeypatch.setattr(_dispatch, "triton_available", lambda: True)
    assert _dispatch.select_backend(_tensor(cuda=True)) == "triton"
    assert _dispatch.select_backend(_tensor(cuda=True, dtype=torch.float64)) == "torch"


def test_cuda_without_triton_falls_back_with_a_warning(monkeypatch):
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    monkeypatch.setattr(_dispatch, "triton_available", lambda: False)
    monkeypatch.setattr(_dispatch, "_warned_no_triton", False)
    with pytest.warns(UserWarning, match="triton is not installed"):
        assert _dispatch.select_backend(_tensor(cuda=True)) == "torch"


def test_env_override(monkeypatch):
    monkeypatch.setattr(_dispatch, "triton_available", lambda: True)
    monkeypatch.setenv(_dispatch.ENV_VAR, "torch")
    assert _dispatch.select_backend(_tensor(cuda=True)) == "torch"
    monkeypatch.setenv(_dispatch.ENV_VAR, "Triton")
    assert _dispatch.select_backend(torch.zeros(1)) == "triton"
    with pytest.raises(TypeError, match="float64"):
        _dispatch.select_backend(torch.zeros(1, dtype=torch.float64))
    monkeypatch.setenv(_dispatch.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="MRL_KERNELS_BACKEND"):
        _dispatch.select_backend(torch.zeros(1))


_NO_TRITON = """
import os, sys
sys.modules["triton"] = None          # any `import triton` now raises ImportError
import torch, mrl_kernels
x = torch.randn(4, 10, requires_grad=True)
logp, ent = mrl_kernels.logprob_entropy(x, torch.tensor([1, 2, -100, 3]))
(logp.sum() + ent.sum()).backward()
h = torch.randn(4, 6, requires_grad=True)
w = torch.randn(10, 6, requires_grad=True)
mrl_kernels.linear_logprob_entropy(h, w, torch.tensor([1, 2, 3, 4]))[0].sum().backward()
assert x.grad is not None and h.grad is not None and w.grad is not None
os.environ["MRL_KERNELS_BACKEND"] = "triton"
try:
    mrl_kernels.logprob_entropy(x, torch.tensor([1, 2, 3, 4]))
except ImportError as exc:
    print("forced triton:", exc)
else:
    raise SystemExit("forcing triton without triton should fail")
"""

_LAZY = """
import sys, torch, mrl_kernels
mrl_kernels.logprob_entropy(torch.randn(3, 5), torch.tensor([0, 1, 2]))
assert "triton" not in sys.modules, "importing/using mrl_kernels on CPU imported triton"
print("lazy ok")
"""


def _python(code):
    env = {k: v for k, v in os.environ.items() if k != _dispatch.ENV_VAR}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)


def test_works_without_triton():
    proc = _python(_NO_TRITON)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "forced triton: MRL_KERNELS_BACKEND=triton but triton is not installed" in proc.stdout


def test_triton_is_imported_lazily():
    proc = _python(_LAZY)
    assert proc.returncode == 0, proc.stdout + proc.stderr
