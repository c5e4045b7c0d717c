"""One guarded optimizer update: check the loss and gradient norm, clip, step, advance the schedule.

megatron's `optimizer.step()` only detects overflow with fp16 loss scaling; with bf16 or fp32
a NaN gradient would silently poison the weights. `guarded_step` splits the step into
megatron's own phases (`prepare_grads` -> `get_grad_norm` -> clip -> `step_with_ready_grads`)
and decides between them, identically on every rank, whether the update may happen.
"""
from __future__ import annotations

import dataclasses
import logging
import math

__all__ = ["NonFiniteError", "StepOutcome", "guarded_step", "inner_optimizers"]

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """A NaN/inf loss or gradient norm under `optim.nonfinite = 'stop'`."""


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    updated: bool          # False: the update was skipped (non-finite, policy 'skip')
    grad_norm: float       # global norm before clipping (NaN/inf when skipped for it)
    lr: float              # learning rate the update used


def inner_optimizers(optimizer) -> list:
    """The megatron optimizers inside `optimizer` (a `ChainedOptimizer`'s parts, else itself)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def guarded_step(optimizer, scheduler, *, loss: float, clip: float, policy: str, where: str) -> StepOutcome:
    """Update the parameters from the accumulated gradients unless the loss or the gradient norm
    is NaN/inf; then `policy` 'skip' drops this update (gradients discarded, schedule not
    advanced) and 'stop' raises `NonFiniteError` naming `where` (step and stage).

    `loss` must already be the same on every rank (reduced over DP, broadcast over PP).
    `clip` > 0 clips the global gradient norm to it. Collective: every rank must call it.
    """
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    lr = float(optimizer.param_groups[0]["lr"])
    found_inf = optimizer.prepare_grads()
    grad_norm = float(optimizer.get_grad_norm())
    from mrl.platform.collectives import world_any

    bad = world_any(bool(found_inf) or not math.isfinite(loss) or not math.isfinite(grad_norm), "non-finite check")
    if bad:
        what = f"{where}: non-finite loss {loss} / gradient norm {grad_norm}"
        if policy == "stop":
            raise NonFiniteError(f"{what}; stopping (optim.nonfinite = 'stop')")
        log.warning("%s; update skipped (optim.nonfinite = 'skip')", what)
        optimizer.zero_grad()
        return StepOutcome(updated=False, grad_norm=grad_norm, lr=lr)
    if clip > 0:
        for opt in inner_optimizers(optimizer):
            params = opt.get_parameters()
            if params and not getattr(opt, "is_stub_optimizer", False):
                clip_grad_by_total_norm_fp32(params, max_norm=clip, total_norm=grad_norm,
                                             use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    if not optimizer.step_with_ready_grads():
        raise RuntimeError(f"{where}: megatron's optimizer step reported failure")
    if scheduler is not None:
        scheduler.step(increment=1)
    return StepOutcome(updated=True, grad_norm=grad_norm, lr=lr)
