"""Kernel tests: run the Triton kernels under the interpreter when there is no GPU.

`triton.jit` decides between compiling and interpreting when a kernel is *decorated*, i.e. when
`mrl_kernels.logprob_triton` is first imported, so TRITON_INTERPRET must be set before that.
It is set here, at collection of this directory, only on machines without CUDA (with a GPU the
tests run the compiled kernels on CUDA tensors instead). `interpreted_kernels()` in kernels_ref
re-imports the kernel module if something imported it earlier without the interpreter.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
