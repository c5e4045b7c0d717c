"""The `algorithm` section: advantage estimator, policy loss, KL, rollout correction, DAPO.

Semantics of every option are in docs/algorithms.md; the functions in this package implement them and
do not read this config (they are pure). The trainer passes these values in.
"""
from __future__ import annotations

from typing import Literal, Optional

from mrl.config.schema import option, section

KL_ESTIMATORS = ("k1", "abs", "k2", "k3", "k3+", "mse", "low_var_kl")
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@section
class KLLossConfig:
    """KL to the reference model as a loss term (GRPO style)."""

    enable: bool = option(False, help="add coef * KL(actor || ref) to the policy loss")
    estimator: Literal[KL_ESTIMATORS] = option("k3", help="k1 | abs | k2 (mse) | k3 (low_var_kl) | k3+")
    coef: float = option(0.001, ge=0, help="KL loss coefficient")


@section
class KLRewardConfig:
    """KL to the reference model subtracted from the token rewards (PPO style)."""

    enable: bool = option(False, help="subtract coef * kl_t from every token reward")
    estimator: Literal[KL_ESTIMATORS] = option("k1", help="k1 | abs | k2 (mse) | k3 (low_var_kl) | k3+")
    coef: float = option(0.001, ge=0, help="initial KL coefficient")
    controller: Literal["fixed", "adaptive"] = option("fixed", help="fixed coefficient or adaptive (Ziegler et al.)")
    target: float = option(6.0, gt=0, help="adaptive controller: target KL")
    horizon: int = option(10000, ge=1, help="adaptive controller: horizon in responses")


@section
class CorrectionConfig:
    """Rollout correction for the train/inference mismatch (TIS / masked IS)."""

    level: Literal["off", "token", "sequence"] = option("off", help="importance weights per token or per sequence")
    mode: Literal["truncate", "mask"] = option("truncate", help="truncate: min(w, threshold) (TIS); mask: zero w outside [mask_low, mask_high]")
    threshold: float = option(2.0, gt=0, help="truncation cap C")
    mask_low: float = option(0.5, ge=0, help="masked IS: lowest kept weight")
    mask_high: float = option(2.0, gt=0, help="masked IS: highest kept weight")
    normalize: bool = option(False, help="rescale weights to mean 1 over the batch")
    old_logprobs: Literal["recompute", "rollout"] = option("recompute", help="recompute old log-probs with the trainer, or use the engine's (bypass)")


@section
class DynamicSamplingConfig:
    """DAPO dynamic sampling: drop groups whose scores are all equal, generate until the step is full."""

    enable: bool = option(False, help="drop zero-variance groups and top up the batch")
    metric: str = option("score", help="which reward output decides equality (e.g. acc)")
    generation_batch_prompts: Optional[int] = option(None, ge=1, help="prompts generated per attempt (default: data.prompts_per_step)")
    max_generation_batches: int = option(10, ge=0, help="attempts per step; 0 = unlimited")
    on_exhausted: Literal["error", "proceed"] = option("error", help="after max attempts: fail, or train on what is kept")


@section
class OverlongConfig:
    """DAPO overlong reward shaping and filtering."""

    enable: bool = option(False, help="add the soft overlong penalty to the score")
    buffer_tokens: int = option(4096, ge=1, help="penalty ramps over the last buffer_tokens of the response budget")
    penalty_factor: float = option(1.0, ge=0, help="penalty at the full response budget")
    mask_truncated: bool = option(False, help="exclude truncated responses from the loss")


@section
class AlgorithmConfig:
    """The RL maths: advantages, policy loss, aggregation, KL, correction, DAPO."""

    advantage: Literal["gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax"] = option("grpo", help="advantage estimator")
    gamma: float = option(1.0, ge=0, le=1, help="discount (gae, reinforce_pp)")
    lam: float = option(1.0, ge=0, le=1, help="GAE lambda")
    norm_by_std: bool = option(True, help="GRPO: divide by the group std; false = Dr.GRPO")
    policy_loss: Literal["ppo", "gspo", "cispo", "sapo"] = option("ppo", help="policy loss")
    clip_low: float = option(0.2, ge=0, lt=1, help="ratio clip below 1 (eps_low)")
    clip_high: float = option(0.2, ge=0, help="ratio clip above 1 (eps_high; DAPO clip-higher 0.28)")
    dual_clip: float = option(3.0, ge=0, help="dual-clip constant c > 1 for A < 0 (ppo); 0 disables")
    sapo_tau_pos: float = option(1.0, gt=0, help="SAPO temperature for A > 0")
    sapo_tau_neg: float = option(1.05, gt=0, help="SAPO temperature for A <= 0")
    loss_aggregation: Optional[Literal[LOSS_AGGREGATIONS]] = option(None, help="token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm (default: token-mean; gspo/sapo force seq-mean-token-mean)")
    loss_norm: Optional[float] = option(None, gt=0, help="seq-mean-token-sum-norm divisor (default: rollout.max_response_tokens)")
    entropy_coef: float = option(0.0, ge=0, help="entropy bonus coefficient")
    value_clip: float = option(0.5, gt=0, help="value-loss clip range eps_v (gae)")
    kl_loss: KLLossConfig = option(factory=KLLossConfig, help="KL as a loss term")
    kl_reward: KLRewardConfig = option(factory=KLRewardConfig, help="KL in the reward")
    correction: CorrectionConfig = option(factory=CorrectionConfig, help="rollout correction")
    dynamic_sampling: DynamicSamplingConfig = option(factory=DynamicSamplingConfig, help="DAPO dynamic sampling")
    overlong: OverlongConfig = option(factory=OverlongConfig, help="DAPO overlong shaping")
