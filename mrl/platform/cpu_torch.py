"""torch as the patched megatron modules see it on the cpu platform (`cpu_compat`'s two mechanisms).

* the **view** (`VIEW`): a stand-in for the module `torch` whose `torch.cuda` answers
  `current_device()` with the cpu device and has no-op streams, events and synchronize, and whose
  factory functions (`zeros(..., device="cuda")` and friends) build on cpu; everything else is the
  real torch;
* the **mode** (`CudaMethodsOnCpu`, entered by `in_mode(fn)`): a `TorchFunctionMode` for what a view
  cannot reach, tensor methods: `t.cuda()` stays on cpu, `t.type()` reports `torch.cuda.*Tensor`,
  `t.to("cuda")` and `device=` keywords map to cpu.

Which megatron modules and functions get them is `cpu_compat`'s table and registry.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import types
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


# --------------------------------------------------------------------------- torch view

def _is_cuda_device(dev: Any) -> bool:
    if isinstance(dev, str):
        return dev.startswith("cuda")
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    # A bare int is a CUDA ordinal for torch factories.
    return isinstance(dev, int) and not isinstance(dev, bool)


class _NullEvent:
    """Stand-in for `torch.cuda.Event` on cpu: work is synchronous, so everything is done."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end) -> float:
        return 0.0


class _NullStream:
    """Stand-in for `torch.cuda.Stream` on cpu (all work runs in order on the host)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _NullEvent()

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True


_DEFAULT_STREAM = _NullStream()


class _NullNvtx:
    @staticmethod
    def range_push(msg):
        pass

    @staticmethod
    def range_pop():
        pass

    @staticmethod
    def range(msg, *args, **kwargs):
        return contextlib.nullcontext()


class _CpuCuda:
    """What a patched megatron module sees as `torch.cuda`; unknown names go to the real one."""

    Stream = _NullStream
    Event = _NullEvent
    nvtx = _NullNvtx

    def __init__(self, real):
        self._real = real

    @staticmethod
    def current_device() -> torch.device:
        return _CPU

    @staticmethod
    def stream(stream=None):
        return contextlib.nullcontext()

    @staticmethod
    def current_stream(device=None):
        return _DEFAULT_STREAM

    @staticmethod
    def default_stream(device=None):
        return _DEFAULT_STREAM

    @staticmethod
    def synchronize(device=None):
        pass

    @staticmethod
    def empty_cache():
        pass

    def __getattr__(self, name):
        return getattr(self._real, name)


_FACTORIES = frozenset({
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
    "randperm", "eye", "linspace", "logspace", "zeros_like", "ones_like", "empty_like", "full_like",
    "rand_like", "randn_like", "randint_like", "empty_strided", "scalar_tensor",
})


def _cpu_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        return fn(*args, **kwargs)

    return wrapper


class _TorchView(types.ModuleType):
    """The `torch` module as seen by a patched megatron module (see the module docstring)."""

    def __init__(self, real):
        super().__init__("torch")
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "cuda", _CpuCuda(real.cuda))
        for name in _FACTORIES:
            if hasattr(real, name):
                object.__setattr__(self, name, _cpu_factory(getattr(real, name)))

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_real"), name)

    def __repr__(self):
        return "<mrl cpu view of module 'torch'>"


VIEW = _TorchView(torch)

# --------------------------------------------------------------------------- tensor-method mode

class CudaMethodsOnCpu(TorchFunctionMode):
    """Keeps tensors on cpu where megatron calls CUDA tensor methods (active only in scoped calls)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type:
            if len(args) == 1 and not kwargs:
                name = func(*args)
                return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
            args = tuple(a.replace("torch.cuda.", "torch.", 1) if isinstance(a, str) else a for a in args)
        elif func is torch.Tensor.to:
            args = tuple(_CPU if _is_cuda_device(a) and not isinstance(a, int) else a for a in args)
        if _is_cuda_device(kwargs.get("device")):
            kwargs = {**kwargs, "device": _CPU}
        return func(*args, **kwargs)


_MODE_DEPTH = threading.local()


def in_mode(fn: Callable) -> Callable:
    """Wrap `fn` so that it runs under `CudaMethodsOnCpu` (re-entrant)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        depth = getattr(_MODE_DEPTH, "n", 0)
        if depth:
            return fn(*args, **kwargs)
        _MODE_DEPTH.n = 1
        try:
            with CudaMethodsOnCpu():
                return fn(*args, **kwargs)
        finally:
            _MODE_DEPTH.n = 0

    wrapper.__mrl_cpu_compat__ = True
    return wrapper
