"""Per-token KL estimators and KL-coefficient controllers.

- `estimate`: Schulman's k1/k2/k3 approximations of KL(pi || pi_ref) from samples of pi
  (J. Schulman, "Approximating KL Divergence", 2020, http://joschu.net/blog/kl-approx.html),
  plus `abs`, and the straight-through `+` variants (value of the estimator, gradient of k2,
  whose gradient is the unbiased gradient of the KL), as in verl's `kl_penalty`.
- `AdaptiveController` (Ziegler et al. 2019, arXiv:1909.08593) and `FixedController` for the
  KL-in-reward coefficient of PPO-style training.
- `mean_per_sequence`: the KL statistic verl feeds to the controller.

KL as a loss term (GRPO style): `aggregate(estimate(lp, lp_ref, kind), mask, mode)` times a
coefficient. KL in the reward (PPO style): `advantages.token_rewards(scores, mask,
kl=estimate(lp_old, lp_ref, kind), beta=controller.value)`.
"""
from __future__ import annotations

import torch

from ._masked import masked_mean, valid

__all__ = ["KINDS", "estimate", "mean_per_sequence", "AdaptiveController", "FixedController"]

_BASE = {"k1": "k1", "kl": "k1", "abs": "abs", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}
KINDS = tuple(_BASE) + tuple(k + "+" for k in _BASE)


def _forward(delta: torch.Tensor, base: str) -> torch.Tensor:
    if base == "k1":
        return delta
    if base == "abs":
        return delta.abs()
    if base == "k2":
        return 0.5 * delta.square()
    # k3 = exp(-delta) + delta - 1 = r - log r - 1 with r = pi_ref/pi; clamps as verl. Evaluated as
    # expm1(-d) + d: same value, but without the cancellation of exp(-d) - 1 for small d
    # (verl's direct form loses every digit in float32 below |d| ~ 1e-3 and can go negative).
    d = torch.clamp(delta, -20.0, 20.0)
    return torch.clamp(torch.expm1(-d) + d, -10.0, 10.0)


def estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate [B,T] from `delta = logp - ref_logp` (no masking, no reduction).

    - `k1` (alias `kl`): `delta`; unbiased, high variance, can be negative. Not clamped.
    - `abs`: `|delta|`. Not clamped.
    - `k2` (alias `mse`): `delta^2 / 2`. Not clamped.
    - `k3` (alias `low_var_kl`): `exp(-delta) + delta - 1` with delta clamped to [-20, 20] and
      the result to [-10, 10] (verl's clamps; the clamps zero the gradient beyond them). Computed
      as `expm1(-delta) + delta`, so it is accurate and >= 0 for tiny delta.
    - a `+` suffix (`k3+`, `k1+`, `abs+`, `low_var_kl+`): the value of the base estimator with
      the gradient of k2: `k2 - sg(k2) + sg(base)`; `k2+`/`mse+` are plain k2.
    Gradients flow into `logp` and `ref_logp` as the formulas say; detach `ref_logp` upstream.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KINDS}")
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp and ref_logp shapes differ: {tuple(logp.shape)} vs {tuple(ref_logp.shape)}")
    straight_through = kind.endswith("+")
    base = _BASE[kind.rstrip("+")]
    delta = logp - ref_logp
    value = _forward(delta, base)
    if not straight_through or base == "k2":
        return value
    k2 = 0.5 * delta.square()
    return k2 - k2.detach() + value.detach()


def mean_per_sequence(kl_tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over non-empty sequences of each sequence's masked token mean (detached, 0-dim).

    verl logs this as `actor/reward_kl_penalty` and feeds it to the KL controller (verl also
    counts fully masked sequences, as 0, in the outer mean).
    """
    ok = valid(mask)
    per_seq = masked_mean(kl_tokens.detach(), ok, dim=-1)
    return masked_mean(per_seq, ok.any(dim=-1))


class FixedController:
    """Constant KL coefficient."""

    def __init__(self, coef: float):
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value


class AdaptiveController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (as verl/TRL).

    `error = clip(current_kl / target - 1, -0.2, 0.2)`; `value *= 1 + error * n_steps / horizon`,
    where `n_steps` is the number of responses in the batch just used.
    """

    def __init__(self, init_coef: float, target: float, horizon: float):
        if not target > 0 or not horizon > 0:
            raise ValueError(f"target and horizon must be > 0, got {target}, {horizon}")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value
