"""Peak temporary memory of a block of torch code, on CUDA and on CPU (tests, benchmark).

CUDA: the caching allocator's peak (`torch.cuda.max_memory_allocated`) minus what was allocated
on entry. CPU has no allocator statistics, so a TorchDispatchMode records the storage of every
tensor an ATen op creates inside the block (forward and autograd backward alike) and a weakref
finalizer on that storage notices when it is freed; the peak is the largest total of
simultaneously alive storages. Views and in-place results (storage shared with an input) are not
new allocations. Scratch buffers private to a single ATen kernel are invisible, and so are
tensors created by Triton launches (there are none on CPU outside the interpreter). The count is
deterministic: the same code gives the same number on every run.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _StorageTracker(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _freed(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {_storage_ptr(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in inputs or key in self.live:
                continue
            self.live[key] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._freed, key)
        return out


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, sparse, ...)
        return -1


class PeakMemory:
    """`with PeakMemory(device) as pm: ...` then `pm.peak` = peak bytes allocated in the block
    above what was allocated on entry (CUDA), or peak bytes of tensors created in it (CPU)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.peak = 0
        self._tracker: _StorageTracker | None = None
        self._base = 0

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._tracker = _StorageTracker()
            self._tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            self._tracker.__exit__(*exc)
            self.peak = self._tracker.peak
