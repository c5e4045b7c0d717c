"""Backend selection: Triton kernels on CUDA tensors, pure-torch twins everywhere else.

`MRL_KERNELS_BACKEND` overrides the choice for every call:

- `auto` (default): Triton when the tensor is on CUDA and Triton imports, otherwise the twin.
- `torch`: always the pure-torch twin (debugging, reference runs on GPU).
- `triton`: always Triton. On CPU tensors this only works under `TRITON_INTERPRET=1`, which
  is how the tests run the real kernels on machines without a GPU.

Triton is imported lazily, the first time a Triton kernel is actually needed, so
`import mrl_kernels` works on machines without Triton.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import warnings
from types import ModuleType

import torch

ENV_VAR = "MRL_KERNELS_BACKEND"
BACKENDS = ("auto", "torch", "triton")

_warned_no_triton = False


def requested_backend() -> str:
    """The backend named by `MRL_KERNELS_BACKEND` (default `auto`); an unknown name is an error."""
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={value!r}: expected one of {', '.join(BACKENDS)}")
    return value


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when the `triton` package can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or stubbed-out triton (sys.modules["triton"] = None)
        return False


def select_backend(tensor: torch.Tensor, requested: str | None = None) -> str:
    """Return "triton" or "torch" for an input tensor. `requested` (a caller's choice, e.g. the
    job's `model.use_fused_kernels = false` -> "torch") wins over `MRL_KERNELS_BACKEND`."""
    global _warned_no_triton
    if requested is not None and requested not in BACKENDS:
        raise ValueError(f"kernel backend {requested!r}: expected one of {', '.join(BACKENDS)}")
    requested = requested or requested_backend()
    if requested == "torch" or tensor.dtype == torch.float64:
        if requested == "triton" and tensor.dtype == torch.float64:
            raise TypeError(f"{ENV_VAR}=triton: the Triton kernels take bf16/fp16/fp32, not float64 "
                            "(float64 is served by the torch twin)")
        return "torch"
    if requested == "triton":
        if not triton_available():
            raise ImportError(f"{ENV_VAR}=triton but triton is not installed")
        return "triton"
    if tensor.is_cuda:
        if triton_available():
            return "triton"
        if not _warned_no_triton:
            warnings.warn("mrl_kernels: CUDA tensor but triton is not installed; using the torch twin "
                          "(slower, materialises fp32 [rows, vocab] chunks)", stacklevel=3)
            _warned_no_triton = True
    return "torch"


def triton_module(name: str) -> ModuleType:
    """Import `mrl_kernels.<name>` (a module that imports triton) on first use."""
    return importlib.import_module(f"mrl_kernels.{name}")
