"""Helpers for the kernel tests: the naive reference and the Triton-module loader."""
from __future__ import annotations

import importlib
import os
import sys

import torch

IGNORE = -100


def naive_logprob_entropy(logits, labels, temperature=1.0, ignore_index=IGNORE):
    """log_softmax/softmax straight from the definitions, with mrl's masking rules spelled out.

    Differentiable through plain autograd; always computes (and returns) float64.
    """
    z = logits.to(torch.float64) / temperature
    dead = torch.isneginf(z).all(-1, keepdim=True)           # fully masked rows
    z = torch.where(dead, torch.zeros_like(z), z)             # keep them finite; zeroed below
    logp_all = torch.log_softmax(z, -1)
    p = torch.softmax(z, -1)
    pz = p * torch.where(torch.isneginf(z), torch.zeros_like(z), z)  # 0 * -inf -> 0, no NaN grad
    entropy = torch.logsumexp(z, -1) - pz.sum(-1)
    has_label = (labels != ignore_index) & ~dead.squeeze(-1)
    picked = logp_all.gather(-1, torch.where(has_label, labels, 0).unsqueeze(-1)).squeeze(-1)
    logp = torch.where(has_label, picked, torch.zeros_like(picked))
    entropy = torch.where(dead.squeeze(-1), torch.zeros_like(entropy), entropy)
    return logp, entropy


def make_case(n, v, dtype=torch.float32, seed=0, scale=3.0, ignore_rows=(), dead_rows=(),
              masked_frac=0.0, masked_label_rows=(), device="cpu"):
    """Random logits/labels with ignored labels, fully masked rows and -inf entries."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g, dtype=torch.float64) * scale
    labels = torch.randint(0, v, (n,), generator=g)
    if masked_frac:
        mask = torch.rand(n, v, generator=g) < masked_frac
        mask[torch.arange(n), labels] = False
        logits[mask] = float("-inf")
    for r in masked_label_rows:
        logits[r, labels[r]] = float("-inf")
    for r in dead_rows:
        logits[r] = float("-inf")
    for r in ignore_rows:
        labels[r] = IGNORE
    return logits.to(dtype).to(device), labels.to(device)


def interpreter_usable() -> bool:
    """Can Triton kernels run in this process (CUDA, or the interpreter on CPU)?

    The interpreter only works if `triton` itself was imported with TRITON_INTERPRET=1 (its
    library functions such as tl.max are decorated at import). If some earlier test imported
    triton first (megatron.core and liger do), the Triton tests rerun in a fresh process.
    """
    if torch.cuda.is_available() or "triton" not in sys.modules:
        return True
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(standard.max, InterpretedFunction)


def interpreted_kernels():
    """`mrl_kernels.logprob_triton`, decorated under the interpreter when there is no GPU."""
    name = "mrl_kernels.logprob_triton"
    mod = importlib.import_module(name)
    if not torch.cuda.is_available():
        from triton.runtime.interpreter import InterpretedFunction
        if not isinstance(mod._stats_kernel, InterpretedFunction):
            os.environ["TRITON_INTERPRET"] = "1"
            mod = importlib.reload(sys.modules[name])
    return mod


def max_err(a, b):
    """Max |a - b| over entries where both are finite; also checks the inf/nan pattern matches."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert torch.equal(torch.isnan(a), torch.isnan(b)), "NaN pattern differs"
    inf = torch.isinf(a)
    assert torch.equal(inf, torch.isinf(b)) and torch.equal(a[inf], b[inf]), "inf pattern differs"
    fin = torch.isfinite(a)
    return (a[fin] - b[fin]).abs().max().item() if fin.any() else 0.0
