"""mrl.algos: the algorithm core, pure torch functions with no dependency on the rest of mrl.

Semantics reference: docs/algorithms.md. Modules:
- `advantages`: gae, grpo (Dr.GRPO via norm_by_std=False), rloo, reinforce_pp,
  reinforce_pp_baseline, remax, opo, grpo_passk, gpg, gdpo, optimal_token_baseline,
  tir_optimal_token_baseline, token_rewards;
- `losses`: ppo (dual-clip), gspo, cispo, sapo, gpg, dppo_tv, dppo_kl, clip_cov, kl_cov, geo_mean,
  dro, reinforce per-token losses; re-exports `aggregation`'s `aggregate` (loss_agg_mode,
  split-invariant with global counts) and clipped `value` loss;
- `kl`: k1/abs/k2/k3 and straight-through `+` estimators, KL controllers;
- `correction`: rollout-correction importance weights (TIS, IcePop-style masking) and mismatch
  metrics;
- `dapo`: overlong penalty and the dynamic-sampling group filter;
- `dpo`: online DPO's preference pairs, pairwise losses (dpo, ipo, simpo) and per-row coefficients;
- `rejection` (+ torch-free `rejection_spec`): rollout rejection-sampling masks, verl's presets,
  PF-PPO resampling.
"""
import importlib

__all__ = ["advantages", "aggregation", "correction", "dapo", "dpo", "kl", "losses", "rejection", "rejection_spec"]


def __getattr__(name: str):
    # Lazy: `mrl.algos.config` is read by the spec loader, which must not pay for importing torch.
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
