"""The `algorithm` section: advantage estimator, policy loss, KL, rollout correction, DAPO.

Semantics of every option are in docs/algorithms.md; the functions in this package implement them and
do not read this config (they are pure). The trainer passes these values in.
"""
from __future__ import annotations

from typing import Literal, Optional, Union

from mrl.algos.rejection_spec import PRESETS
from mrl.schema.section import option, section

_KL_BASE = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
KL_ESTIMATORS = _KL_BASE + tuple(k + "+" for k in _KL_BASE)
"""Every name of `mrl.algos.kl.KINDS` (verl's `kl_penalty` names; `+` = straight-through k2 gradient)."""
LOSS_AGGREGATIONS = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
ADVANTAGES = ("gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "opo", "grpo_passk", "gpg", "gdpo",
              "optimal_token_baseline", "tir_optimal_token_baseline", "distill")
POLICY_LOSSES = ("ppo", "gspo", "cispo", "sapo", "gpg", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov", "geo_mean", "dro",
                 "reinforce")
OBJECTIVES = ("pg", "dpo")
DPO_LOSSES = ("dpo", "ipo", "simpo")     # mrl.algos.dpo.DPO_LOSSES (this module is torch-free)
DPO_PAIRINGS = ("best_worst", "margin")  # mrl.algos.dpo.PAIRINGS
REJECTION_PRESETS = tuple(PRESETS)
"""The names of `mrl.algos.rejection.PRESETS` (verl's RolloutCorrectionConfig presets)."""


@section
class KLLossConfig:
    """KL to the reference model as a loss term (GRPO style)."""

    enable: bool = option(False, help="add coef * KL(actor || ref) to the policy loss")
    estimator: Literal[KL_ESTIMATORS] = option("k3", help="k1 (kl) | abs | k2 (mse) | k3 (low_var_kl), each also with + (value of it, gradient of k2)")
    coef: float = option(0.001, ge=0, help="KL loss coefficient")


@section
class KLRewardConfig:
    """KL to the reference model subtracted from the token rewards (PPO style)."""

    enable: bool = option(False, help="subtract coef * kl_t from every token reward")
    estimator: Literal[KL_ESTIMATORS] = option("k1", help="k1 (kl) | abs | k2 (mse) | k3 (low_var_kl), each also with + (value of it, gradient of k2)")
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
    rejection: Optional[str] = option(None, help="rejection sampling criteria, comma-separated: token_k1|k2|k3, seq_sum_k1|k2|k3, "
                                                 "seq_mean_k1|k2|k3, seq_max_k2|k3 (verl's rollout_rs); none = off")
    rejection_threshold: Optional[Union[float, str]] = option(None, help="a number, or one spec per criterion or one for all: k1 "
                                                                        "'lower_upper' ratios (or 'upper'), others an upper bound "
                                                                        "(verl's rollout_rs_threshold)")
    preset: Optional[Literal[REJECTION_PRESETS]] = option(None, help="a verl RolloutCorrectionConfig preset by name; sets level, "
                                                                     "threshold, rejection, old_logprobs, (IcePop) mode and mask bounds, and (bypass_pg_*) policy_loss")


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
class PFPPOConfig:
    """Policy Filtration PPO: resample each rank's responses by a weight of their scores."""

    enable: bool = option(False, help="resample the batch with replacement after the advantages (verl's use_pf_ppo)")
    method: Literal["pow", "max_min", "max_random"] = option("pow", help="pow: |score|^weight_pow; max_min: only best and worst; max_random: best 0.4, others 0.1")
    weight_pow: float = option(2.0, help="exponent of the pow method")


@section
class DPOConfig:
    """Online DPO (`algorithm.objective = "dpo"`): preference pairs from each group, a pairwise loss."""

    loss: Literal[DPO_LOSSES] = option("dpo", help="dpo: -log sigmoid(beta h); ipo: (h - 1/(2 beta))^2; simpo: "
                                                   "length-normalised, reference-free, target margin gamma")
    beta: float = option(0.1, gt=0, help="inverse temperature of the implicit reward (ipo: the regulariser tau)")
    pairs: Literal[DPO_PAIRINGS] = option("best_worst", help="best_worst: one pair per group; margin: every pair of a "
                                                              "group whose scores differ by more than margin")
    margin: float = option(0.0, ge=0, help="a pair's scores must differ by more than this")
    gamma: float = option(0.0, ge=0, help="simpo: target reward margin")


@section
class AlgorithmConfig:
    """The RL maths: advantages, policy loss, aggregation, KL, correction, DAPO."""

    objective: Literal[OBJECTIVES] = option("pg", help="pg: policy gradient (advantages, policy_loss); dpo: online DPO "
                                                       "on preference pairs from each group ([algorithm.dpo])")
    advantage: Literal[ADVANTAGES] = option("grpo", help="advantage estimator")
    gdpo_reward_keys: tuple[str, ...] = option((), help="gdpo: reward components normalised separately ('score', a source name, or a key the rewards return)")
    gdpo_reward_weights: tuple[float, ...] = option((), help="gdpo: weight of each component (default all 1)")
    gamma: float = option(1.0, ge=0, le=1, help="discount (gae, reinforce_pp)")
    lam: float = option(1.0, ge=0, le=1, help="GAE lambda")
    norm_by_std: bool = option(True, help="GRPO: divide by the group std; false = Dr.GRPO")
    policy_loss: Literal[POLICY_LOSSES] = option("ppo", help="policy loss")
    clip_low: float = option(0.2, ge=0, help="ratio clip below 1 (eps_low); 1 or more: no lower clip (ratios are positive; CISPO's verl setting is 10)")
    clip_high: float = option(0.2, ge=0, help="ratio clip above 1 (eps_high; DAPO clip-higher 0.28)")
    dual_clip: float = option(3.0, ge=0, help="dual-clip constant c > 1 for A < 0 (ppo), ratio cap (dppo_tv, dppo_kl); 0 disables (verl's clip_ratio_c)")
    sapo_tau_pos: float = option(1.0, gt=0, help="SAPO temperature for A > 0")
    sapo_tau_neg: float = option(1.05, gt=0, help="SAPO temperature for A <= 0")
    clip_cov_ratio: float = option(0.0002, gt=0, help="clip_cov: fraction of tokens whose gradient is cut")
    clip_cov_lb: float = option(1.0, help="clip_cov: lowest covariance of a cut token")
    clip_cov_ub: float = option(5.0, help="clip_cov: highest covariance of a cut token")
    kl_cov_ratio: float = option(0.0002, gt=0, help="kl_cov: fraction of tokens given the KL penalty")
    kl_cov_coef: float = option(0.1, ge=0, help="kl_cov: coefficient of |lp - lp_old| (verl's ppo_kl_coef, default 0.1 as verl's config)")
    dro_beta: float = option(0.1, gt=0, help="dro: quadratic penalty coefficient")
    loss_aggregation: Optional[Literal[LOSS_AGGREGATIONS]] = option(None, help="token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm (default: token-mean; sapo/geo_mean force seq-mean-token-mean)")
    loss_norm: Optional[float] = option(None, gt=0, help="seq-mean-token-sum-norm divisor (default: rollout.max_response_tokens)")
    entropy_coef: float = option(0.0, ge=0, help="entropy bonus coefficient")
    value_clip: float = option(0.5, gt=0, help="value-loss clip range eps_v (gae)")
    kl_loss: KLLossConfig = option(factory=KLLossConfig, help="KL as a loss term")
    kl_reward: KLRewardConfig = option(factory=KLRewardConfig, help="KL in the reward")
    correction: CorrectionConfig = option(factory=CorrectionConfig, help="rollout correction")
    dynamic_sampling: DynamicSamplingConfig = option(factory=DynamicSamplingConfig, help="DAPO dynamic sampling")
    overlong: OverlongConfig = option(factory=OverlongConfig, help="DAPO overlong shaping")
    pf_ppo: PFPPOConfig = option(factory=PFPPOConfig, help="PF-PPO resampling")
    dpo: DPOConfig = option(factory=DPOConfig, help="online DPO (objective = 'dpo')")
