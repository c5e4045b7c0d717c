"""Rejection-sampling criteria and verl's rollout-correction presets, without torch (the spec
validator reads them). The masks themselves are in `mrl.algos.rejection`."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

__all__ = ["CRITERIA", "Criterion", "Preset", "PRESETS", "parse", "parse_problem", "expand_preset"]

CRITERIA = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
            "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


@dataclass(frozen=True)
class Criterion:
    """One rejection criterion: `name` in CRITERIA, bounds `lower` (k1 only, a ratio) and `upper`."""

    name: str
    upper: float
    lower: Optional[float] = None


@dataclass(frozen=True)
class Preset:
    """A verl `RolloutCorrectionConfig` preset: IS level/threshold, rejection criteria, bypass."""

    is_level: Optional[str]          # "token" | "sequence" | None
    rs: Optional[str]                # comma-separated criteria, or None
    rs_threshold: Optional[str]      # verl's threshold spec for them
    bypass: bool = False             # old log-probs = the rollout engine's
    loss_type: str = "ppo_clip"      # "ppo_clip" | "reinforce" (bypass only)
    icepop: Optional[tuple[float, float]] = None   # IS weights zeroed outside [lo, hi] (mode "mask"), not truncated


PRESETS: dict[str, Preset] = {
    "decoupled_token_is": Preset("token", None, None),
    "decoupled_seq_is": Preset("sequence", None, None),
    "decoupled_token_icepop": Preset("token", None, None, icepop=(0.5, 5.0)),
    "decoupled_seq_is_rs": Preset("sequence", "seq_sum_k1", "0.5_2.0"),
    "decoupled_geo_rs": Preset(None, "seq_mean_k1", "0.999_1.001"),
    "decoupled_geo_rs_seq_tis": Preset("sequence", "seq_mean_k1", "0.999_1.001"),
    "decoupled_geo_rs_token_tis": Preset("token", "seq_mean_k1", "0.999_1.001"),
    "decoupled_k3_rs": Preset(None, "seq_mean_k3", "0.01"),
    "decoupled_k3_rs_seq_tis": Preset("sequence", "seq_mean_k3", "0.01"),
    "decoupled_k3_rs_token_tis": Preset("token", "seq_mean_k3", "0.01"),
    "bypass_ppo_clip": Preset(None, None, None, bypass=True),
    "bypass_ppo_clip_geo_rs": Preset(None, "seq_mean_k1", "0.999_1.001", bypass=True),
    "bypass_ppo_clip_k3_rs": Preset(None, "seq_mean_k3", "0.01", bypass=True),
    "bypass_pg_is": Preset("sequence", None, None, bypass=True, loss_type="reinforce"),
    "bypass_pg_token_icepop": Preset("token", None, None, bypass=True, loss_type="reinforce", icepop=(0.5, 5.0)),
    "bypass_pg_geo_rs": Preset(None, "seq_mean_k1", "0.999_1.001", bypass=True, loss_type="reinforce"),
    "bypass_pg_geo_rs_seq_tis": Preset("sequence", "seq_mean_k1", "0.999_1.001", bypass=True, loss_type="reinforce"),
    "bypass_pg_geo_rs_token_tis": Preset("token", "seq_mean_k1", "0.999_1.001", bypass=True, loss_type="reinforce"),
}
"""verl 0.9.1's presets (`RolloutCorrectionConfig.<name>()` with its default thresholds; IS threshold 2;
the two `*_token_icepop` presets: IcePop's `rollout_is_threshold = "0.5_5.0"`, mrl's `mode = "mask"`)."""


def parse(criteria: str, threshold: str | float) -> list[Criterion]:
    """verl's `rollout_rs` / `rollout_rs_threshold` pair as criteria; raises ValueError on a bad spec.

    `criteria`: comma-separated names (duplicates dropped). `threshold`: one spec shared by all,
    or one per criterion, comma-separated. A k1 spec is `lower_upper` (ratios) or `upper`
    (then lower = 1/upper) with lower <= upper; any other spec is a single positive upper bound
    (verl 0.9.1's `_parse_rollout_rs_thresholds` raises on the same specs).
    """
    names = list(dict.fromkeys(c.strip() for c in criteria.split(",") if c.strip()))
    if not names:
        raise ValueError("no rejection criterion given")
    for n in names:
        if n not in CRITERIA:
            raise ValueError(f"unknown rejection criterion {n!r}; expected one of {', '.join(CRITERIA)}")
    specs = [p.strip() for p in str(threshold).split(",") if p.strip()]
    if len(specs) == 1:
        specs = specs * len(names)
    if len(specs) != len(names):
        raise ValueError(f"{len(names)} criteria need 1 or {len(names)} thresholds, got {len(specs)}")
    out = []
    for n, spec in zip(names, specs):
        try:
            if n.endswith("k1"):
                lo, _, hi = spec.partition("_")
                upper = float(hi) if hi else float(lo)
                lower = float(lo) if hi else 1.0 / upper
            elif "_" in spec:
                raise ValueError(f"{n} takes one upper bound, not {spec!r}")
            else:
                upper, lower = float(spec), None
        except ZeroDivisionError:
            raise ValueError(f"threshold for {n} must be positive, got {spec!r}") from None
        except ValueError as e:
            raise ValueError(str(e) if "takes one" in str(e) else f"threshold {spec!r} for {n} is not a number") from None
        if not upper > 0 or (lower is not None and not lower > 0):
            raise ValueError(f"threshold for {n} must be positive, got {spec!r}")
        if lower is not None and lower > upper:
            raise ValueError(f"threshold for {n} must be 'lower_upper' with lower <= upper, got {spec!r}")
        out.append(Criterion(n, upper, lower))
    return out


def parse_problem(criteria: str, threshold: str | float) -> Optional[str]:
    """`parse`'s error message for this pair, or None when it parses."""
    try:
        parse(criteria, threshold)
    except ValueError as e:
        return str(e)
    return None


def expand_preset(alg):
    """The `algorithm` section with `correction.preset` written out into the fields it stands for
    (IS level, rejection criteria and threshold; IcePop: mode = "mask" with its bounds; bypass:
    old_logprobs = "rollout"; bypass_pg_*:
    policy_loss = "reinforce" where the job left "ppo"). A field the job sets to other than its
    default keeps the job's value. The preset is then cleared, so the resolved spec says
    everything explicitly (and resolves to itself)."""
    cor = alg.correction
    if cor.preset is None:
        return alg
    preset = PRESETS[cor.preset]
    default = type(cor)()
    changes = {"preset": None}
    if cor.level == default.level:
        changes["level"] = preset.is_level or "off"
    if cor.rejection is None:
        changes["rejection"] = preset.rs
    if cor.rejection_threshold is None:
        changes["rejection_threshold"] = preset.rs_threshold
    if preset.icepop is not None:
        for name, value in zip(("mode", "mask_low", "mask_high"), ("mask",) + preset.icepop):
            if getattr(cor, name) == getattr(default, name):
                changes[name] = value
    if preset.bypass and cor.old_logprobs == default.old_logprobs:
        changes["old_logprobs"] = "rollout"
    alg = replace(alg, correction=replace(cor, **changes))
    if preset.loss_type == "reinforce" and alg.policy_loss == "ppo":   # the default: the preset chooses
        alg = replace(alg, policy_loss="reinforce")
    return alg
