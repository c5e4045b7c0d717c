"""Fused Triton kernels and their pure-torch twins (installed as `mrl_kernels`).

Public API (Triton on CUDA tensors, the torch twin elsewhere; `MRL_KERNELS_BACKEND` overrides):

- `logprob_entropy(logits, labels, temperature=1.0, *, group=None, ignore_index=-100)`
- `linear_logprob_entropy(hidden, weight, labels, temperature=1.0, *, group=None, ...)`

See kernels/README.md for semantics, dispatch and the memory model. Importing this package does
not import triton.
"""
from mrl_kernels.linear_logprob import linear_logprob_entropy
from mrl_kernels.logprob import IGNORE_INDEX, logprob_entropy

__all__ = ["IGNORE_INDEX", "linear_logprob_entropy", "logprob_entropy"]
