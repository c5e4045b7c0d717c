"""verl 0.9.1 algorithm names in the spec: defaults, presets written out, and combinations accepted."""
from mrl.config.loader import load


def test_gspo_defaults_to_token_mean_and_accepts_any_aggregation(write_job):
    spec, _ = load(write_job({"algorithm": {"policy_loss": "gspo"}}))
    assert spec.algorithm.loss_aggregation == "token-mean"       # verl 0.9.1's default for every loss
    spec, _ = load(write_job({"algorithm": {"policy_loss": "gspo", "loss_aggregation": "seq-mean-token-mean"}}))
    assert spec.algorithm.loss_aggregation == "seq-mean-token-mean"
    spec, _ = load(write_job({"algorithm": {"policy_loss": "geo_mean"}}))
    assert spec.algorithm.loss_aggregation == "seq-mean-token-mean"


def test_preset_is_written_out(write_job):
    spec, _ = load(write_job({"algorithm": {"correction": {"preset": "bypass_pg_geo_rs_token_tis"}}}))
    alg = spec.algorithm
    assert alg.policy_loss == "reinforce" and alg.correction.old_logprobs == "rollout"
    assert (alg.correction.level, alg.correction.rejection, alg.correction.rejection_threshold) == \
        ("token", "seq_mean_k1", "0.999_1.001")
    assert alg.correction.preset is None
    # a field the job sets keeps its value
    spec, _ = load(write_job({"algorithm": {"correction": {"preset": "decoupled_k3_rs", "rejection_threshold": "0.02"}}}))
    assert (spec.algorithm.correction.level, spec.algorithm.correction.rejection,
            spec.algorithm.correction.rejection_threshold) == ("off", "seq_mean_k3", "0.02")
    assert spec.algorithm.policy_loss == "ppo" and spec.algorithm.correction.old_logprobs == "recompute"


def test_new_names_validate(write_job, cli):
    for patch in ({"advantage": "gdpo", "gdpo_reward_keys": ["acc", "formatted"], "gdpo_reward_weights": [1.0, 0.5]},
                  {"advantage": "opo", "policy_loss": "dppo_kl"}, {"advantage": "gpg", "policy_loss": "gpg"},
                  {"advantage": "grpo_passk", "policy_loss": "clip_cov", "loss_aggregation": "token-sum"},
                  {"policy_loss": "kl_cov", "kl_loss": {"enable": True, "estimator": "abs+"}},
                  {"policy_loss": "dro", "pf_ppo": {"enable": True, "method": "max_min"}},
                  {"policy_loss": "reinforce", "correction": {"old_logprobs": "rollout", "level": "sequence"}},
                  {"correction": {"rejection": "token_k1,seq_max_k2", "rejection_threshold": "0.5_2,0.1"}}):
        rc, out, err = cli("validate", write_job({"algorithm": patch}))
        assert rc == 0, (patch, out, err)


def test_keys_algorithm_lists_every_verl_name(cli):
    import json

    from mrl.algos.config import ADVANTAGES, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES, REJECTION_PRESETS

    rc, out, _ = cli("keys", "algorithm", "--json")
    types = {r["key"]: r["type"] for r in json.loads(out)}
    assert rc == 0
    expected = {"algorithm.advantage": ("opo", "grpo_passk", "gpg", "gdpo", "optimal_token_baseline",
                                        "tir_optimal_token_baseline"),
                "algorithm.policy_loss": ("dppo_tv", "dppo_kl", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro", "reinforce"),
                "algorithm.loss_aggregation": ("token-sum",),
                "algorithm.kl_loss.estimator": ("kl", "k1+", "abs+", "low_var_kl+", "kl+", "mse+"),
                "algorithm.correction.preset": ("bypass_pg_geo_rs_token_tis", "decoupled_k3_rs")}
    for key, names in expected.items():
        for name in names:
            assert repr(name) in types[key], (key, name)
    for key, names in {"algorithm.advantage": ADVANTAGES, "algorithm.policy_loss": POLICY_LOSSES,
                       "algorithm.loss_aggregation": LOSS_AGGREGATIONS, "algorithm.kl_reward.estimator": KL_ESTIMATORS,
                       "algorithm.correction.preset": REJECTION_PRESETS}.items():
        assert all(repr(n) in types[key] for n in names), key


def test_rejection_threshold_is_a_number_or_a_spec(write_job):
    """verl's rollout_rs_threshold is a float or a string ("0.5_2.0"): both are accepted, in the file
    and on the command line, where only a plain decimal is a number (TOML would read 0.5_2 as 0.52)."""
    from mrl.config.overrides import _parse_override_value
    from mrl.algos.config import CorrectionConfig
    from mrl.schema.section import fields_of
    from mrl.errors import SpecError
    import pytest

    spec, _ = load(write_job({"algorithm": {"correction": {"rejection": "seq_mean_k3", "rejection_threshold": 0.01}}}))
    assert spec.algorithm.correction.rejection_threshold == 0.01
    spec, _ = load(write_job({"algorithm": {"correction": {"rejection": "token_k1", "rejection_threshold": 2}}}))
    assert spec.algorithm.correction.rejection_threshold == 2.0          # an integer is a number
    spec, _ = load(write_job({"algorithm": {"correction": {"rejection": "seq_mean_k1"}}}),
                   ["algorithm.correction.rejection_threshold=0.5_2.0"])
    assert spec.algorithm.correction.rejection_threshold == "0.5_2.0"
    tp = fields_of(CorrectionConfig)["rejection_threshold"].type
    assert _parse_override_value("0.01", tp) == 0.01 and _parse_override_value("1e-3", tp) == 0.001
    assert _parse_override_value("0.5_2", tp) == "0.5_2" and _parse_override_value("'0.5'", tp) == "0.5"
    assert _parse_override_value("none", tp) is None
    with pytest.raises(SpecError) as e:
        load(write_job({"algorithm": {"correction": {"rejection": "seq_mean_k3", "rejection_threshold": True}}}))
    assert "rejection_threshold: must be a number or a string, got a boolean (true)" in e.value.problems[0]
    with pytest.raises(SpecError) as e:   # a number is checked like a spec
        load(write_job({"algorithm": {"correction": {"rejection": "seq_mean_k3", "rejection_threshold": -1}}}))
    assert "must be positive" in e.value.problems[0]


def test_a_union_type_takes_its_first_fitting_member():
    from typing import Optional, Union

    import pytest

    from mrl.schema.section import optional_inner, union_members
    from mrl.schema.value import ValueProblem, convert

    tp = Optional[Union[float, str]]
    assert optional_inner(tp) == Union[float, str] and union_members(Union[float, str]) == (float, str)
    assert convert(3, tp) == 3.0 and isinstance(convert(3, tp), float)
    assert convert("a", tp) == "a" and convert(None, tp) is None
    with pytest.raises(ValueProblem, match="must be a number or a string, got a list"):
        convert([1], Union[float, str])


def test_icepop_presets_are_written_out(write_job, cli):
    """verl 0.9.1's decoupled_token_icepop / bypass_pg_token_icepop: token-level IS with
    rollout_is_threshold "0.5_5.0", which zeroes weights outside [0.5, 5] (mrl's mode = "mask")."""
    spec, _ = load(write_job({"algorithm": {"correction": {"preset": "decoupled_token_icepop"}}}))
    cor = spec.algorithm.correction
    assert (cor.level, cor.mode, cor.mask_low, cor.mask_high, cor.rejection, cor.old_logprobs) == \
        ("token", "mask", 0.5, 5.0, None, "recompute")
    assert spec.algorithm.policy_loss == "ppo"
    spec, _ = load(write_job({"algorithm": {"correction": {"preset": "bypass_pg_token_icepop", "mask_high": 3.0}}}))
    cor = spec.algorithm.correction
    assert (cor.level, cor.mode, cor.mask_low, cor.mask_high, cor.old_logprobs) == ("token", "mask", 0.5, 3.0, "rollout")
    assert spec.algorithm.policy_loss == "reinforce"
    for preset in ("decoupled_token_icepop", "bypass_pg_token_icepop"):
        rc, out, err = cli("validate", write_job({"algorithm": {"correction": {"preset": preset}}}))
        assert rc == 0, (preset, out, err)


def test_validate_refuses_a_k1_threshold_with_lower_above_upper(write_job, cli):
    # verl 0.9.1 raises "Thresholds for option 'token_k1' must be lower <= upper, got 2.0_0.5."
    rc, out, err = cli("validate", write_job({"algorithm": {"correction": {"rejection": "token_k1",
                                                                            "rejection_threshold": "2.0_0.5"}}}))
    assert rc != 0
    assert "algorithm.correction.rejection: threshold for token_k1 must be 'lower_upper' with lower <= upper, " \
           "got '2.0_0.5'" in out + err
    assert "Traceback" not in out + err
