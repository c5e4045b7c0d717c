"""The full-vocabulary reverse KL `KL(pi_student || pi_teacher)` per response token, from
vocabulary-parallel logits (on-policy distillation, `distill.estimator = "full"`).

Both models' logits `[N, V/tp]` are sharded the same way over the tensor-parallel group (one
tokenizer, one vocabulary size, one layout); the vocabulary is never gathered: the maxima, sums
of exponentials and the KL's partial sums are all-reduced over the group. The backward is local
to each shard, `dKL/dz_v = p_v (log p_v - log q_v - KL) / T` (`z` the student's logits, `p` its
distribution, `q` the teacher's, `T` the temperature), recomputed from the saved logits rather
than stored (two `[N, V/tp]` float32 tensors would be the largest activations of the step).
Columns of Megatron's vocabulary padding hold `-inf` (`mrl.models.roles.mask_padded_vocab`) in
both and contribute nothing.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["reverse_kl"]


def _log_softmax(z: torch.Tensor, group) -> torch.Tensor:
    top = z.detach().amax(-1, keepdim=True)
    if group is not None:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    sums = torch.exp(z - top).sum(-1, keepdim=True)
    if group is not None:
        dist.all_reduce(sums, group=group)
    return z - top - sums.log()


def _parts(student: torch.Tensor, teacher: torch.Tensor, temperature: float, group):
    ls = _log_softmax(student.float() / temperature, group)
    lt = _log_softmax(teacher.float() / temperature, group)
    ps = ls.exp()
    diff = torch.where(ps > 0, ls - lt, torch.zeros_like(ls))   # padding columns: 0 * (-inf - -inf)
    return ps, diff


class _ReverseKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, teacher, temperature, group):
        ps, diff = _parts(student, teacher, temperature, group)
        kl = (ps * diff).sum(-1)
        if group is not None:
            dist.all_reduce(kl, group=group)
        ctx.save_for_backward(student, teacher, kl)
        ctx.temperature, ctx.group = temperature, group
        return kl

    @staticmethod
    def backward(ctx, grad):
        student, teacher, kl = ctx.saved_tensors
        ps, diff = _parts(student, teacher, ctx.temperature, ctx.group)
        g = grad.float().unsqueeze(-1) * ps * (diff - kl.unsqueeze(-1)) / ctx.temperature
        return g.to(student.dtype), None, None, None


def reverse_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0,
               group: Optional[object] = None) -> torch.Tensor:
    """`[N]` float32 `sum_v p_v (log p_v - log q_v)` at each row; differentiable in `student`
    (the teacher's logits take no gradient). `group`: the tensor-parallel group the vocabulary is
    split over (None: whole rows)."""
    return _ReverseKL.apply(student, teacher.detach(), float(temperature), group)
