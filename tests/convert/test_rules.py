"""The value rules of `mrl convert` (pure functions of an entry and a resolved verl config) and
the Hydra parts it reproduces (overrides, interpolations), on hand-made inputs."""
from __future__ import annotations

import pytest

from mrl.config.verl_table import Mapping, parse_table
from mrl.convert import rules
from mrl.convert.verl_config import VerlConfig, apply_override, resolve
from mrl.errors import UserError

BUDGET = Mapping("a.micro", ("actor.micro_batch_tokens",), rule="token_budget",
                 params={"sequences": "a.micro", "tokens": "a.max_tokens", "dynamic": "a.dynamic"})


def test_token_budget_counts_sequences_at_the_longest_length():
    cfg = {"a.micro": 3, "a.max_tokens": 9000, "a.dynamic": False,
           "data.max_prompt_length": 100, "data.max_response_length": 412}
    assert rules.token_budget(BUDGET, "a.micro", cfg).values == {"actor.micro_batch_tokens": 3 * 512}
    # the token limit is not read without dynamic batching
    assert rules.token_budget(BUDGET, "a.max_tokens", cfg).skipped.startswith("verl reads it only with a.dynamic")
    cfg["a.dynamic"] = True
    assert rules.token_budget(BUDGET, "a.micro", cfg).values == {"actor.micro_batch_tokens": 9000}
    assert rules.token_budget(BUDGET, "a.max_tokens", cfg).values == {"actor.micro_batch_tokens": 9000}


@pytest.mark.parametrize("filtered, side, expected", [(True, "error", "drop"), (True, "right", "drop"),
                                                      (False, "error", "error"), (False, "left", "truncate_left"),
                                                      (False, "right", None), (False, "middle", None)])
def test_prompt_overflow(filtered, side, expected):
    m = Mapping("data.truncation", ("data.prompt_overflow",), rule="prompt_overflow")
    t = rules.prompt_overflow(m, "data.truncation", {"data.filter_overlong_prompts": filtered, "data.truncation": side})
    assert t.values.get("data.prompt_overflow") == expected
    assert (t.problem is not None) == (expected is None)


def test_copy_values_none_and_unset():
    m = Mapping("k", ("x",), values={"vanilla": "ppo", "true": "full"}, none="off", unset=(-1,))
    assert rules.copy(m, "k", {"k": "vanilla"}).values == {"x": "ppo"}
    assert rules.copy(m, "k", {"k": "gspo"}).values == {"x": "gspo"}        # same name: passes through
    assert rules.copy(m, "k", {"k": True}).values == {"x": "full"}
    assert rules.copy(m, "k", {"k": None}).values == {"x": "off"}
    assert rules.copy(m, "k", {"k": -1}).skipped


def test_clip_ratio_is_the_fallback_of_low_and_high():
    m = Mapping("a.clip_ratio", ("algorithm.clip_low", "algorithm.clip_high"), rule="clip_ratio")
    cfg = {"a.clip_ratio": 0.3, "a.clip_ratio_low": None, "a.clip_ratio_high": 0.28}
    assert rules.clip_ratio(m, "a.clip_ratio", cfg).values == {"algorithm.clip_low": 0.3}
    cfg["a.clip_ratio_low"] = 0.2
    assert rules.clip_ratio(m, "a.clip_ratio", cfg).skipped


def test_small_rules():
    pair = Mapping("b", ("o.beta1", "o.beta2"), rule="pair")
    assert rules.pair(pair, "b", {"b": [0.9, 0.95]}).values == {"o.beta1": 0.9, "o.beta2": 0.95}
    times = Mapping("r", ("o.min_lr",), rule="times", params={"of": "lr"})
    assert rules.times(times, "r", {"r": 0.1, "lr": 2e-6}).values == {"o.min_lr": pytest.approx(2e-7)}
    each = Mapping("l", ("t.backends",), rule="each", values={"console": "console", "mlflow": "mlflow"})
    t = rules.each(each, "l", {"l": ["wandb", "mlflow"]})
    assert t.values == {"t.backends": ["mlflow"]} and "wandb not available" in t.note
    sleep = Mapping("s", ("rollout.sleep_level",), rule="sleep_level")
    assert rules.sleep_level(sleep, "s", {"s": False}).values == {"rollout.sleep_level": 0}
    when = Mapping("sp", ("p.sp",), rule="when", params={"flag": "tp", "above": 1})
    assert rules.when(when, "sp", {"sp": True, "tp": 1}).skipped
    assert rules.when(when, "sp", {"sp": True, "tp": 2}).values == {"p.sp": True}
    fn = Mapping("c.path", ("reward.function", "reward.builtin"), rule="reward_function",
                 params={"path": "c.path", "name": "c.name"})
    assert rules.reward_function(fn, "c.path", {"c.path": "r.py", "c.name": None}).values == {
        "reward.function": "r.py:compute_score"}
    assert rules.reward_function(fn, "c.path", {"c.path": None}).values == {"reward.builtin": "auto"}


def test_critic_gate():
    assert rules.critic_in_use({"algorithm.adv_estimator": "gae", "critic.enable": None})
    assert not rules.critic_in_use({"algorithm.adv_estimator": "grpo", "critic.enable": None})
    assert rules.critic_in_use({"algorithm.adv_estimator": "grpo", "critic.enable": True})


def test_hydra_overrides():
    cfg = VerlConfig(raw={"a.b": 1, "a.c": 2}, origin={"a.b": "d", "a.c": "d"})
    apply_override("a.b=[x,y]", cfg, {})
    apply_override("+a.d=1e-6", cfg, {})
    apply_override("++a.c=null", cfg, {})
    assert cfg.raw == {"a.b": ["x", "y"], "a.c": None, "a.d": 1e-6}
    # Hydra refuses +key on a key that is set; a script written for another verl version does it,
    # so mrl convert reads it as ++key and says so. On a null value Hydra adds (router_replay).
    apply_override("+a.b=3", cfg, {})
    assert cfg.raw["a.b"] == 3 and "+a.b adds a key" in cfg.notes[-1] and "read as ++a.b" in cfg.notes[-1]
    apply_override("+a.c=4", cfg, {})
    assert cfg.raw["a.c"] == 4 and len(cfg.notes) == 1
    apply_override("~a", cfg, {})
    assert cfg.raw == {}
    with pytest.raises(UserError, match="no key a.z to delete"):
        apply_override("~a.z", cfg, {})


def test_interpolations():
    cfg = VerlConfig(raw={"x.n": 4, "x.m": "${.n}", "y.k": "${oc.select:x.missing,7}", "y.s": "n=${x.n}",
                          "z.a": "${z.b}", "z.b": "${z.a}", "z.c": "${nope.key}"})
    values, unresolved = resolve(cfg)
    assert values["x.m"] == 4 and values["y.k"] == 7 and values["y.s"] == "n=4"
    assert "cycle" in unresolved["z.a"] and "no key nope.key" in unresolved["z.c"]


def test_table_data_errors_are_named():
    with pytest.raises(ValueError, match="both mapped and not applicable"):
        parse_table({"mapped": {"a": "b"}, "not_applicable": {"a": "why"}})
    with pytest.raises(ValueError, match="reason '@missing'"):
        parse_table({"not_applicable": {"a": "@missing"}})


@pytest.mark.parametrize("estimator, norm_by_std, pf_ppo", [
    ("grpo", False, None), ("gdpo", None, None), ("grpo_vectorized", None, None), ("gae", False, True)])
def test_settings_verl_reads_only_with_some_estimators_convert_only_there(estimator, norm_by_std, pf_ppo):
    """verl 0.9.1's compute_advantage (ray_trainer.py) applies PF-PPO only in its GAE branch and never
    passes norm_adv_by_std_in_grpo to grpo_vectorized or gdpo; mrl applies both with every estimator,
    so a converted job keeps verl's meaning only if the key is dropped where verl ignores it."""
    from mrl.convert import convert

    conv = convert([], [f"algorithm.adv_estimator={estimator}", "algorithm.norm_adv_by_std_in_grpo=false",
                        "algorithm.use_pf_ppo=true"])
    values = {k: c.value for k, c in conv.values.items()}
    assert values.get("algorithm.norm_by_std") == norm_by_std
    assert values.get("algorithm.pf_ppo.enable") == pf_ppo
