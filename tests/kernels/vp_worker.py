"""Vocab-parallel log-prob/entropy on every rank vs. the single-rank result (run under torchrun).

Every rank builds the same full problem (same seed), computes the single-rank reference, then
the vocab-parallel result from its own vocabulary slice with the world as TP group, and checks
forward outputs and gradients (its slice of the full logits/weight gradient; the full hidden
gradient). The backend comes from MRL_KERNELS_BACKEND (torch twin or Triton under the
interpreter). Exits non-zero with a message on the first mismatch.
"""
import os
import sys

import torch
import torch.distributed as dist

import mrl_kernels

IGNORE = -100


def check(name, got, want, tol):
    got, want = got.detach().double(), want.detach().double()
    inf = torch.isinf(want)
    same_inf = torch.equal(torch.isinf(got), inf) and torch.equal(got[inf], want[inf])
    fin = torch.isfinite(want)
    err = (got[fin] - want[fin]).abs().max().item() if fin.any() else 0.0
    if not same_inf or torch.isnan(got).any() or err > tol:
        raise AssertionError(f"rank {dist.get_rank()}: {name}: max err {err:.3g} > {tol} "
                             f"(inf pattern equal: {same_inf})")
    return err


def logits_case(rank, world, dtype, temperature, n=24, v_local=250):
    g = torch.Generator().manual_seed(0)
    v = v_local * world
    full = torch.randn(n, v, generator=g) * 3
    labels = torch.randint(0, v, (n,), generator=g)
    labels[2] = IGNORE
    full[torch.rand(n, v, generator=g) < 0.1] = float("-inf")
    full[4] = float("-inf")                               # dead row on every rank
    full[5, :v_local] = float("-inf")                     # dead on rank 0's slice only
    full[6, labels[6]] = float("-inf")                    # masked label
    labels[7], labels[8] = 0, v - 1                       # labels at both slice edges
    full = full.to(dtype)
    g2 = torch.Generator().manual_seed(1)
    a, b = torch.randn(n, generator=g2), torch.randn(n, generator=g2)

    def run(x, group):
        x = x.clone().requires_grad_()
        logp, ent = mrl_kernels.logprob_entropy(x, labels, temperature, group=group)
        (logp.masked_fill(torch.isinf(logp), 0) * a + ent * b).sum().backward()
        return logp, ent, x.grad

    ref = run(full, None)
    lo = rank * v_local
    got = run(full[:, lo:lo + v_local], dist.group.WORLD)
    tol = 5e-5
    grad_tol = tol if dtype == torch.float32 else 1e-2 * ref[2].abs().max().item()
    errs = (check("logp", got[0], ref[0], tol), check("entropy", got[1], ref[1], tol),
            check("grad slice", got[2], ref[2][:, lo:lo + v_local], grad_tol))
    print(f"rank {rank} logits {dtype} T={temperature}: max err logp {errs[0]:.2e} entropy "
          f"{errs[1]:.2e} grad {errs[2]:.2e}", flush=True)


def linear_case(rank, world, dtype, temperature, n=20, h=12, v_local=150):
    g = torch.Generator().manual_seed(2)
    v = v_local * world
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 0.5).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[3] = IGNORE
    labels[4], labels[5] = v_local - 1, v_local            # both sides of the rank boundary

    def run(w, group):
        hh, ww = hidden.clone().requires_grad_(), w.clone().requires_grad_()
        logp, ent = mrl_kernels.linear_logprob_entropy(hh, ww, labels, temperature, group=group,
                                                       chunk_tokens=8, chunk_vocab=64)
        (logp.sum() - 0.5 * ent.sum()).backward()
        return logp, ent, hh.grad, ww.grad

    ref = run(weight, None)
    lo = rank * v_local
    got = run(weight[lo:lo + v_local], dist.group.WORLD)
    tol = 5e-5 if dtype == torch.float32 else 3e-2
    errs = (check("linear logp", got[0], ref[0], tol), check("linear entropy", got[1], ref[1], tol),
            check("linear grad hidden (full on every rank)", got[2], ref[2], tol),
            check("linear grad weight slice", got[3], ref[3][lo:lo + v_local], tol))
    print(f"rank {rank} linear {dtype}: max err logp {errs[0]:.2e} entropy {errs[1]:.2e} "
          f"grad_hidden {errs[2]:.2e} grad_weight {errs[3]:.2e}", flush=True)


def empty_case():
    x = torch.zeros(0, 10, requires_grad=True)
    logp, ent = mrl_kernels.logprob_entropy(x, torch.zeros(0, dtype=torch.long), group=dist.group.WORLD)
    (logp.sum() + ent.sum()).backward()
    assert logp.shape == (0,) and x.grad.shape == (0, 10)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = os.environ.get("MRL_KERNELS_BACKEND", "auto")
    for dtype in (torch.float32, torch.bfloat16):
        for temperature in (1.0, 0.7):
            logits_case(rank, world, dtype, temperature)
        linear_case(rank, world, dtype, 0.9)
    empty_case()
    dist.barrier()
    print(f"rank {rank}/{world} backend={backend}: vocab-parallel OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
