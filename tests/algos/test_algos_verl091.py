"""The estimators, losses, aggregation, KL names, rejection sampling and PF-PPO verl 0.9.1 registers,
each against values computed by hand (in the comments)."""
import math

import pytest
import torch

from mrl.algos import advantages as adv
from mrl.algos import config as algo_config
from mrl.algos import kl, losses, rejection

F64 = torch.float64
LN2 = math.log(2.0)


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


# ---------------------------------------------------------------------------- advantages

def test_opo_length_weighted_baseline():
    # group 0: scores 1, 0 with 1 and 3 valid tokens: b = (1*1 + 3*0) / 4 = 0.25
    # group 1 has one response: baseline 0, keeps its score 2
    mask = t([[1, 0, 0], [1, 1, 1], [1, 1, 0]])
    got = adv.opo(t([1.0, 0.0, 2.0]), torch.tensor([0, 0, 5]), mask)
    torch.testing.assert_close(got, t([0.75, -0.25, 2.0]))


def test_grpo_passk_only_the_best_learns():
    # scores 1, 3, 2: best = 3, second = 2, difference 1; unbiased std of (1, 3, 2) = 1
    g = torch.tensor([0, 0, 0])
    torch.testing.assert_close(adv.grpo_passk(t([1.0, 3.0, 2.0]), g), t([0.0, 1.0 / (1.0 + 1e-6), 0.0]))
    torch.testing.assert_close(adv.grpo_passk(t([1.0, 3.0, 2.0]), g, norm_by_std=False), t([0.0, 1.0, 0.0]))
    # a tie at the top: r_max - r_second = 0 for the first best, 0 for everyone
    torch.testing.assert_close(adv.grpo_passk(t([2.0, 2.0, 0.0]), g), t([0.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="at least 2"):
        adv.grpo_passk(t([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]))


def test_gpg_rescales_by_the_share_of_nonzero_scores():
    # B = 4, two nonzero scores: alpha = 2; group means 0.5 -> 2 * (+-0.5)
    got = adv.gpg(t([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    torch.testing.assert_close(got, t([1.0, -1.0, -1.0, 1.0]))
    # the counts are those of all ranks with all_reduce: here a fake doubling B only -> alpha = 4
    doubled_b = lambda c: torch.stack([c[0] * 2, c[1]])  # noqa: E731
    torch.testing.assert_close(adv.gpg(t([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]), all_reduce=doubled_b),
                               t([2.0, -2.0, -2.0, 2.0]))


def test_gdpo_normalises_each_component_then_whitens():
    # acc (1, 0 | 0, 1) and fmt (0, 1 | 0, 1): each group's GRPO gives +-1/sqrt(2) (std sqrt(1/2));
    # sum: (0, 0, -sqrt 2, sqrt 2); whitened over 4 one-token responses: var = 4/3 -> (0, 0, -1.2247, 1.2247)
    comps = t([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [1.0, 1.0]])
    mask = torch.ones(4, 1)
    got = adv.gdpo(comps, torch.tensor([0, 0, 1, 1]), mask)
    s = math.sqrt(2) / math.sqrt(4 / 3) * (1 / (1 + 1e-6 * math.sqrt(2)))
    torch.testing.assert_close(got[:, 0], t([0.0, 0.0, -s, s]), atol=1e-6, rtol=1e-6)
    # weight 0 on fmt: acc alone, +-0.7071 whitened with var 2/3 -> +-0.8660
    got = adv.gdpo(comps, torch.tensor([0, 0, 1, 1]), mask, weights=t([1.0, 0.0]))
    torch.testing.assert_close(got[:, 0], t([0.8660254, -0.8660254, -0.8660254, 0.8660254]), atol=1e-5, rtol=1e-5)


def test_optimal_token_baseline_weights_by_path_variance():
    # pi = 0.5 / 0.25, sum pi^2 = 0.5: per-token variance 1 - 2 pi + 0.5 = 0.5 / 1.0, W = (0.5, 1) / (1, 2)
    # returns (1, 1) and (0, 0): B_0 = 0.5 / 1.5 = 1/3, B_1 = 1 / 3 -> adv (2/3, 2/3), (-1/3, -1/3)
    rewards, mask = t([[0.0, 1.0], [0.0, 0.0]]), torch.ones(2, 2)
    old = torch.log(t([[0.5, 0.5], [0.25, 0.25]]))
    a, returns = adv.optimal_token_baseline(rewards, mask, torch.tensor([0, 0]), old, torch.full((2, 2), 0.5, dtype=F64))
    torch.testing.assert_close(returns, t([[1.0, 1.0], [0.0, 0.0]]))
    torch.testing.assert_close(a, t([[2 / 3, 2 / 3], [-1 / 3, -1 / 3]]), atol=1e-7, rtol=1e-7)


def test_optimal_token_baseline_zero_tail():
    # response 0 is alone beyond length 1: with handle_zero_tail its baseline there is 0 (adv = G = 1)
    rewards, mask = t([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]), t([[1, 1, 1], [1, 0, 0]])
    old, sq = torch.log(torch.full((2, 3), 0.5, dtype=F64)), torch.full((2, 3), 0.5, dtype=F64)
    a, _ = adv.optimal_token_baseline(rewards, mask, torch.tensor([0, 0]), old, sq, handle_zero_tail=True)
    torch.testing.assert_close(a, t([[0.5, 1.0, 1.0], [-0.5, 0.0, 0.0]]), atol=1e-7, rtol=1e-7)
    a, _ = adv.optimal_token_baseline(rewards, mask, torch.tensor([0, 0]), old, sq, handle_zero_tail=False)
    torch.testing.assert_close(a, t([[0.5, 0.0, 0.0], [-0.5, 0.0, 0.0]]), atol=1e-7, rtol=1e-7)  # B = G W / (W + eps)


def test_optimal_token_baseline_zero_tail_is_the_default_as_in_verl():
    # verl 0.9.1 core_algos.compute_optimal_token_baseline_advantage(handle_zero_tail=True by default;
    # ray_trainer.compute_advantage does not override it). One group: A has 2 tokens and score 1, B 1 token
    # and score 0; p_old 0.5, sum pi^2 0.5 -> per-token variance 0.5, W_A = (0.5, 1), W_B = (0.5).
    # t = 0: B = (1 * 0.5 + 0 * 0.5) / 1 = 0.5 -> (0.5, -0.5); t = 1: only A, zero tail -> B = 0, adv 1.
    # (Without the zero tail: 1 - 1 / (1 + 1e-8) = 1e-8.) verl gives [[0.5, 1.0], [-0.5, 0]].
    rewards, mask = t([[0.0, 1.0], [0.0, 0.0]]), t([[1, 1], [1, 0]])
    old, sq = torch.log(torch.full((2, 2), 0.5, dtype=F64)), torch.full((2, 2), 0.5, dtype=F64)
    a, _ = adv.optimal_token_baseline(rewards, mask, torch.tensor([0, 0]), old, sq)
    torch.testing.assert_close(a, t([[0.5, 1.0], [-0.5, 0.0]]), atol=1e-7, rtol=0)
    a, _ = adv.optimal_token_baseline(rewards, mask, torch.tensor([0, 0]), old, sq, handle_zero_tail=False)
    torch.testing.assert_close(a[0, 1], t(1e-8), atol=1e-12, rtol=0)


def test_tir_optimal_token_baseline_aligns_policy_tokens_across_observations():
    # response 0 = policy, observation, policy; response 1 = two policy tokens. Compacted both are
    # two tokens with W = (0.5, 1) and G = (1, 1) / (0, 0): baseline 0.5 at both policy positions.
    rewards, mask = t([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]), t([[1, 0, 1], [1, 1, 0]])
    old, sq = torch.log(torch.full((2, 3), 0.5, dtype=F64)), torch.full((2, 3), 0.5, dtype=F64)
    a, _ = adv.tir_optimal_token_baseline(rewards, mask, torch.tensor([0, 0]), old, sq)
    torch.testing.assert_close(a, t([[0.5, 0.0, 0.5], [-0.5, -0.5, 0.0]]), atol=1e-7, rtol=1e-7)
    # position-aligned OTB compares response 0's last token with nothing: baseline 1 there, adv 0
    a, _ = adv.optimal_token_baseline(rewards, mask, torch.tensor([0, 0]), old, sq)
    torch.testing.assert_close(a, t([[0.5, 0.0, 0.0], [-0.5, 0.0, 0.0]]), atol=1e-7, rtol=1e-7)


# ---------------------------------------------------------------------------- losses

def _lp(p):
    return torch.log(t(p)).requires_grad_(True)


def test_gpg_loss_is_plain_policy_gradient():
    lp = _lp([[0.5]])
    pt, _ = losses.gpg(lp, lp.detach() - 1.0, t([2.0]), torch.ones(1, 1))
    torch.testing.assert_close(pt, t([[2 * LN2]]))   # -2 * log 0.5
    pt.sum().backward()
    torch.testing.assert_close(lp.grad, t([[-2.0]]))


def test_dppo_tv_keeps_tokens_within_the_tv_budget():
    # p_old = 0.5, p = 0.8 (r = 1.6), A = 1: p - p_old = 0.3
    old = torch.log(t([[0.5]]))
    pt, m = losses.dppo_tv(_lp([[0.8]]), old, t([1.0]), torch.ones(1, 1), 0.2, 0.2)
    torch.testing.assert_close(pt, t([[0.0]]))            # 0.3 > eps_high 0.2: dropped
    assert float(m["clipfrac"]) == 1.0
    lp = _lp([[0.8]])
    pt, m = losses.dppo_tv(lp, old, t([1.0]), torch.ones(1, 1), 0.2, 0.4)
    torch.testing.assert_close(pt, t([[-1.6 * math.log(0.8)]]))   # kept: -A * sg(r) * lp = 0.35703
    pt.sum().backward()
    torch.testing.assert_close(lp.grad, t([[-1.6]]))
    # the IS weight is truncated at clip_c: r = 1.6 > 1.5
    pt, m = losses.dppo_tv(_lp([[0.8]]), old, t([1.0]), torch.ones(1, 1), 0.2, 0.4, 1.5)
    torch.testing.assert_close(pt, t([[-1.5 * math.log(0.8)]]))
    assert float(m["truncfrac"]) == 1.0
    # A < 0 with p = 0.2: p - p_old = -0.3 < -eps_low: dropped
    pt, _ = losses.dppo_tv(_lp([[0.2]]), old, t([-1.0]), torch.ones(1, 1), 0.2, 0.2)
    torch.testing.assert_close(pt, t([[0.0]]))


def test_dppo_kl_bounds_the_binary_kl():
    # p_old = 0.5, p = 0.8: D = 0.5*(log .5 - log .8) + 0.5*log(.5/.2) = 0.22314
    old = torch.log(t([[0.5]]))
    d = 0.5 * (math.log(0.5) - math.log(0.8)) + 0.5 * math.log((0.5 + 1e-8) / (0.2 + 1e-8))
    assert abs(d - 0.22314) < 1e-5
    pt, _ = losses.dppo_kl(_lp([[0.8]]), old, t([1.0]), torch.ones(1, 1), 0.2, 0.2)
    torch.testing.assert_close(pt, t([[0.0]]))                           # D > 0.2
    pt, _ = losses.dppo_kl(_lp([[0.8]]), old, t([1.0]), torch.ones(1, 1), 0.2, 0.3)
    torch.testing.assert_close(pt, t([[-1.6 * math.log(0.8)]]))          # D <= 0.3
    pt, _ = losses.dppo_kl(_lp([[0.8]]), old, t([-1.0]), torch.ones(1, 1), 0.01, 0.01)
    torch.testing.assert_close(pt, t([[1.6 * math.log(0.8)]]))           # A < 0, p >= p_old: always kept


def test_clip_cov_cuts_high_covariance_tokens():
    # A = (1, -1, .5, .5), lp = (0, -2, -1, -1), r = 1: mean A = .25, mean lp = -1
    # cov = (.75*1, -1.25*-1, 0, 0) = (.75, 1.25, 0, 0)
    lp = torch.tensor([[0.0, -2.0, -1.0, -1.0]], dtype=F64, requires_grad=True)
    a, mask = t([[1.0, -1.0, 0.5, 0.5]]), torch.ones(1, 4)
    pt, m = losses.clip_cov(lp, lp.detach(), a, mask, 0.2, 0.2, ratio=0.5, cov_low=0.5, cov_high=5.0)
    torch.testing.assert_close(pt, t([[0.0, 0.0, -0.5, -0.5]]))   # 2 = int(0.5 * 4) tokens cut
    assert float(m["clipfrac"]) == 0.5
    pt, m = losses.clip_cov(lp, lp.detach(), a, mask, 0.2, 0.2, ratio=0.5, cov_low=1.0, cov_high=5.0)
    torch.testing.assert_close(pt, t([[-1.0, 0.0, -0.5, -0.5]]))  # only cov 1.25 is a candidate
    pt.sum().backward()
    torch.testing.assert_close(lp.grad, t([[-1.0, 0.0, -0.5, -0.5]]))


def test_kl_cov_penalises_the_top_covariance_token():
    # same A and lp; lp - lp_old = (0, -.2, 0, 0); k = max(1, int(4 * .25)) = 1 -> token 1 (cov 1.25)
    # token 1: -A r + |d| = exp(-.2) + .2 = 1.01873
    lp = torch.tensor([[0.0, -2.0, -1.0, -1.0]], dtype=F64, requires_grad=True)
    old = lp.detach() + t([[0.0, 0.2, 0.0, 0.0]])
    pt, m = losses.kl_cov(lp, old, t([[1.0, -1.0, 0.5, 0.5]]), torch.ones(1, 4), ratio=0.25, kl_coef=1.0)
    torch.testing.assert_close(pt, t([[-1.0, math.exp(-0.2) + 0.2, -0.5, -0.5]]))
    assert float(m["klfrac"]) == 0.25


def test_geo_mean_clips_token_log_ratios_then_takes_the_geometric_mean():
    # d = (.5, -.1), clip [-.4, .4]: A > 0 -> min(d, clip) = (.4, -.1), mean .15 -> loss -exp(.15)
    old = torch.log(t([[0.5, 0.5]]))
    lp = (old + t([[0.5, -0.1]])).requires_grad_(True)
    pt, m = losses.geo_mean(lp, old, t([1.0]), torch.ones(1, 2), 0.4, 0.4)
    torch.testing.assert_close(pt, t([[-math.exp(0.15)] * 2]))
    assert float(m["clipfrac_upper"]) == 0.5
    # A < 0 -> max(d, clip) = (.5, -.1), mean .2 -> loss +exp(.2)
    pt, _ = losses.geo_mean(lp, old, t([-1.0]), torch.ones(1, 2), 0.4, 0.4)
    torch.testing.assert_close(pt, t([[math.exp(0.2)] * 2]))
    # correction weights enter as their geometric mean over the sequence: sqrt(4 * 1) = 2
    pt, _ = losses.geo_mean(lp, old, t([1.0]), torch.ones(1, 2), 0.4, 0.4, weights=t([[4.0, 1.0]]))
    torch.testing.assert_close(pt, t([[-2 * math.exp(0.15)] * 2]), atol=1e-8, rtol=1e-8)
    assert losses.FORCED_AGG_MODE["geo_mean"] == "seq-mean-token-mean"


def test_dro_quadratic_penalty():
    # lp = log .5, lp_old = log .25: d = ln 2; L = -(A lp - beta/2 d^2) = ln 2 + 0.05 ln^2 2 = 0.71717
    lp = _lp([[0.5]])
    pt, _ = losses.dro(lp, torch.log(t([[0.25]])), t([1.0]), torch.ones(1, 1), beta=0.1)
    torch.testing.assert_close(pt, t([[LN2 + 0.05 * LN2 ** 2]]))
    pt.sum().backward()
    torch.testing.assert_close(lp.grad, t([[-1.0 + 0.1 * LN2]]))   # -A + beta * d


def test_reinforce_with_is_weights_to_the_rollout_policy():
    # lp = (log .5, log .5), rollout (log .25, log .5): token weights (2, 1), sequence weight 2
    roll, mask = torch.log(t([[0.25, 0.5]])), torch.ones(1, 2)
    lp = _lp([[0.5, 0.5]])
    pt, _ = losses.reinforce(lp, roll, t([1.0]), mask, "token", 2.0)
    torch.testing.assert_close(pt, t([[2 * LN2, LN2]]))
    pt.sum().backward()
    torch.testing.assert_close(lp.grad, t([[-2.0, -1.0]]))           # -sg(w) * A
    pt, _ = losses.reinforce(_lp([[0.5, 0.5]]), roll, t([1.0]), mask, "sequence", 2.0)
    torch.testing.assert_close(pt, t([[2 * LN2, 2 * LN2]]))
    pt, _ = losses.reinforce(_lp([[0.5, 0.5]]), roll, t([1.0]), mask, "token", 1.5)
    torch.testing.assert_close(pt, t([[1.5 * LN2, LN2]]))            # truncated at C = 1.5
    pt, _ = losses.reinforce(_lp([[0.5, 0.5]]), roll, t([1.0]), mask)
    torch.testing.assert_close(pt, t([[LN2, LN2]]))                  # no IS: plain REINFORCE


def test_token_sum_aggregation():
    pt, mask = t([[1.0, 2.0], [3.0, 9.0]]), t([[1, 1], [1, 0]])
    assert float(losses.aggregate(pt, mask, "token-sum")) == 6.0
    assert float(losses.aggregate(pt, mask, "token-sum", dp_size=2)) == 12.0   # DP averaging cancelled


def test_gspo_is_aggregated_as_configured():
    assert "gspo" not in losses.FORCED_AGG_MODE


# ---------------------------------------------------------------------------- KL names

@pytest.mark.parametrize("name", algo_config.KL_ESTIMATORS)
def test_every_configurable_kl_name_is_an_estimator(name):
    # delta = lp - lp_ref = ln 2: k1 = ln 2, abs = ln 2, k2 = ln^2 2 / 2, k3 = 1/2 + ln 2 - 1
    values = {"k1": LN2, "abs": LN2, "k2": LN2 ** 2 / 2, "k3": 0.5 + LN2 - 1}
    base = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}.get(name.rstrip("+"), name.rstrip("+"))
    lp = torch.log(t([0.5])).requires_grad_(True)
    est = kl.estimate(lp, torch.log(t([0.25])), name)
    torch.testing.assert_close(est, t([values[base]]))
    est.sum().backward()
    grads = {"k1": 1.0, "abs": 1.0, "k2": LN2, "k3": 1 - 0.5}   # d/d lp
    torch.testing.assert_close(lp.grad, t([LN2 if name.endswith("+") else grads[base]]))


# ---------------------------------------------------------------------------- rejection sampling

def _rs_inputs():
    # lr = lp_old - lp_roll: row 0 (.1, -.1), row 1 (1, 0)
    roll = torch.zeros(2, 2, dtype=F64)
    return t([[0.1, -0.1], [1.0, 0.0]]), roll, torch.ones(2, 2)


@pytest.mark.parametrize("criteria,threshold,keep", [
    # token_k1: -lr within [log .5, log 2]: row 1 token 0 (-1) is out
    ("token_k1", "0.5_2", [[1, 1], [0, 1]]),
    ("token_k1", "2", [[1, 1], [0, 1]]),                  # one bound: lower = 1/2
    ("seq_sum_k1", "0.5_2", [[1, 1], [0, 0]]),            # sums 0 and -1
    ("seq_mean_k1", "0.999_1.001", [[1, 1], [0, 0]]),     # means 0 and -.5
    ("token_k2", "0.1", [[1, 1], [0, 1]]),                # lr^2/2: .005, .005 | .5, 0
    ("seq_max_k2", "0.1", [[1, 1], [0, 0]]),
    ("seq_sum_k2", "0.011", [[1, 1], [0, 0]]),            # .01 | .5
    ("seq_mean_k3", "0.01", [[1, 1], [0, 0]]),            # (e^.1-1.1 + e^-.1-.9)/2 = .0050 | (e-2)/2 = .359
    ("token_k3", "0.7", [[1, 1], [0, 1]]),                # e - 2 = .718 > .7
    ("seq_max_k3", "0.72", [[1, 1], [1, 1]]),
    ("token_k2,seq_mean_k3", "0.6,0.01", [[1, 1], [0, 0]]),   # every criterion must pass
])
def test_rejection_masks(criteria, threshold, keep):
    old, roll, mask = _rs_inputs()
    got = rejection.mask(old, roll, mask, rejection.parse(criteria, threshold))
    assert got.tolist() == [[bool(x) for x in row] for row in keep]


def test_rejection_metrics_and_padding():
    old, roll, mask = _rs_inputs()
    m = rejection.mask_metrics(old, roll, mask, rejection.parse("token_k1", "0.5_2"))
    assert float(m["masked_fraction"]) == 0.25 and float(m["seq_masked_fraction"]) == 0.5
    assert float(m["token_k1/masked_fraction"]) == 0.25
    # a padded token never counts and never passes
    padded = t([[1, 1], [1, 0]])
    old_pad = old.clone()
    old_pad[1, 1] = float("nan")
    got = rejection.mask(old_pad, roll, padded, rejection.parse("seq_sum_k2", "0.6"))
    assert got.tolist() == [[True, True], [True, False]]


def test_rejection_parse_errors_and_presets():
    with pytest.raises(ValueError, match="one upper bound"):
        rejection.parse("seq_mean_k3", "0.5_2")
    with pytest.raises(ValueError, match="unknown rejection criterion"):
        rejection.parse("seq_max_k1", "2")
    with pytest.raises(ValueError, match="2 criteria need 1 or 2 thresholds"):
        rejection.parse("token_k1,token_k2", "2,1,1")
    with pytest.raises(ValueError, match="positive"):
        rejection.parse("token_k2", "-1")
    p = rejection.PRESETS["bypass_pg_geo_rs_token_tis"]
    assert (p.is_level, p.rs, p.rs_threshold, p.bypass, p.loss_type) == ("token", "seq_mean_k1", "0.999_1.001", True,
                                                                          "reinforce")
    assert len(rejection.PRESETS) == 18 and tuple(rejection.PRESETS) == algo_config.REJECTION_PRESETS
    for p in rejection.PRESETS.values():   # every preset's criteria parse
        if p.rs:
            rejection.parse(p.rs, p.rs_threshold)


def test_rejection_refuses_a_k1_threshold_with_lower_above_upper():
    # verl 0.9.1 rollout_corr_helper._parse_rollout_rs_thresholds raises ("must be lower <= upper")
    with pytest.raises(ValueError, match="lower <= upper, got '2.0_0.5'"):
        rejection.parse("token_k1", "2.0_0.5")
    with pytest.raises(ValueError, match="lower <= upper"):
        rejection.parse("seq_mean_k1,token_k2", "1.001_0.999,0.1")
    assert rejection.parse("token_k1", "1.5_1.5")[0] == rejection.Criterion("token_k1", 1.5, 1.5)   # equal is fine
    from mrl.algos.rejection_spec import parse_problem   # what `mrl validate` reports

    assert parse_problem("token_k1", "2.0_0.5") == \
        "threshold for token_k1 must be 'lower_upper' with lower <= upper, got '2.0_0.5'"


def test_overall_seq_masked_fraction_counts_every_row():
    # verl 0.9.1 compute_rollout_rejection_mask: rollout_rs_seq_masked_fraction = seq_has_masked.float().mean()
    # over all rows; the per-option one divides by the non-empty rows. Row 0 has a rejected token
    # (-lr = -1 < log 0.5), row 1 is empty: verl 0.5 overall, 1.0 for the option; 0.5 of the tokens.
    old, roll, mask = t([[0.0, 1.0], [0.0, 0.0]]), torch.zeros(2, 2, dtype=F64), t([[1, 1], [0, 0]])
    m = rejection.mask_metrics(old, roll, mask, rejection.parse("token_k1", "0.5_2.0"))
    assert float(m["seq_masked_fraction"]) == 0.5 and float(m["token_k1/seq_masked_fraction"]) == 1.0
    assert float(m["masked_fraction"]) == 0.5 and float(m["token_k1/masked_fraction"]) == 0.5


def test_icepop_presets_zero_weights_outside_half_to_five():
    # verl 0.9.1 RolloutCorrectionConfig.decoupled_token_icepop() / bypass_pg_token_icepop(): rollout_is = "token",
    # rollout_is_threshold = "0.5_5.0" (IcePop: weights outside [0.5, 5] zeroed, the mask left alone)
    for name, bypass, loss_type in (("decoupled_token_icepop", False, "ppo_clip"),
                                    ("bypass_pg_token_icepop", True, "reinforce")):
        p = rejection.PRESETS[name]
        assert (p.is_level, p.rs, p.icepop, p.bypass, p.loss_type) == ("token", None, (0.5, 5.0), bypass, loss_type)


# ---------------------------------------------------------------------------- verl 0.9.1 differences, fixed

def test_geo_mean_averages_over_every_row_as_verl():
    # verl 0.9.1 compute_policy_loss_geo_mean: pg_loss = torch.mean(pg_losses) over all rows. 2 rows x 1 token,
    # row 1 fully masked, A = 1, lp = lp_old: row 0's loss -exp(0) = -1, row 1's 0 -> verl -0.5.
    lp = torch.zeros(2, 1, dtype=F64, requires_grad=True)
    mask = t([[1], [0]])
    pt, _ = losses.geo_mean(lp, lp.detach(), t([1.0, 1.0]), mask, 0.2, 0.2)
    assert "geo_mean" in losses.ALL_ROWS_LOSSES
    got = losses.aggregate(pt, mask, losses.FORCED_AGG_MODE["geo_mean"], global_sequences=2)   # the row count
    torch.testing.assert_close(got, t(-0.5))   # (A = 1 / (1 + 1e-8), as verl's masked mean)
    torch.testing.assert_close(losses.aggregate(pt, mask, "seq-mean-token-mean"), t(-1.0))   # non-empty rows: not verl


def test_bypass_reinforce_sequence_weight_spans_rejected_tokens():
    # verl 0.9.1 compute_policy_loss_bypass_mode: IS weights over the response mask, rejection afterwards.
    # 1 row x 2 tokens, lp - lp_roll = (0, 0.5); token_k2 at 0.01 rejects token 1 (0.5^2 / 2 = 0.125).
    # Sequence weight exp(0 + 0.5) = 1.6487 (under the cap 2) on token 0; A = 1 -> gradient -1.6487.
    roll = torch.log(t([[0.5, 0.5]]))
    lp = (roll + t([[0.0, 0.5]])).requires_grad_(True)
    full = torch.ones(1, 2)
    keep = rejection.mask(lp.detach(), roll, full, rejection.parse("token_k2", "0.01"))
    assert keep.tolist() == [[True, False]]
    pt, m = losses.reinforce(lp, roll, t([1.0]), keep.double(), "sequence", 2.0, is_mask=full)
    pt.sum().backward()
    torch.testing.assert_close(lp.grad, t([[-math.exp(0.5), 0.0]]))
    torch.testing.assert_close(m["is_weight_mean"], t(math.exp(0.5)))
    lp.grad = None   # over the rejected mask alone the weight would be exp(0) = 1
    pt, _ = losses.reinforce(lp, roll, t([1.0]), keep.double(), "sequence", 2.0)
    pt.sum().backward()
    torch.testing.assert_close(lp.grad, t([[-1.0, 0.0]]))


# ---------------------------------------------------------------------------- verl 0.9.1 differences, kept
# (each documented with its reason in docs/algorithms.md, "Where mrl departs from verl 0.9.1")

def test_whitening_all_equal_values_gives_zero():
    # verl 0.9.1 masked_whiten: mean = sum / (n + 1e-8) -> for two valid entries of 1 in float64,
    # (1 - 1/(1 + 5e-9)) * rsqrt(var + 1e-8) = 5e-5 each; mrl: exactly 0 (GDPO, REINFORCE++, GAE whitening).
    from mrl.algos._masked import masked_whiten

    assert masked_whiten(t([[1.0], [1.0]]), torch.ones(2, 1)).tolist() == [[0.0], [0.0]]
    got = adv.gdpo(t([[1.0], [1.0]]), torch.tensor([0, 1]), torch.ones(2, 1))   # groups of one: A = 1/(1+1e-6) each
    assert got.tolist() == [[0.0], [0.0]]


def test_grpo_all_equal_float32_group_gives_zero():
    # verl 0.9.1 compute_grpo_outcome_advantage on three float32 scores 1.7694676: torch.mean misses the value by
    # one rounding step and (s - mean) / (std + 1e-6) gives -0.104 each; mrl's statistics in float64: exactly 0.
    s = torch.full((3,), 1.7694675922393799, dtype=torch.float32)
    assert adv.grpo(s, torch.tensor([0, 0, 0])).tolist() == [0.0, 0.0, 0.0]


def test_norm_by_std_applies_to_gdpo():
    # verl 0.9.1's trainer passes norm_adv_by_std_in_grpo to grpo only (gdpo and grpo_vectorized keep True);
    # mrl honours it. Groups (1, 0) and (2, 0), one token each:
    # with std both groups give +-0.7071 -> whitened (var 4 * 0.5 / 3) +-0.8660;
    # without, +-0.5 and +-1 -> whitened (var (2 * 0.25 + 2 * 1) / 3 = 5/6) +-0.5477, +-1.0954.
    comps, g, mask = t([[1.0], [0.0], [2.0], [0.0]]), torch.tensor([0, 0, 1, 1]), torch.ones(4, 1)
    torch.testing.assert_close(adv.gdpo(comps, g, mask)[:, 0], t([0.8660254, -0.8660254] * 2), atol=1e-5, rtol=0)
    s = 1 / math.sqrt(5 / 6)
    torch.testing.assert_close(adv.gdpo(comps, g, mask, norm_by_std=False)[:, 0], t([0.5 * s, -0.5 * s, s, -s]),
                               atol=1e-7, rtol=0)


def test_kl_cov_breaks_ties_at_the_top_k_boundary_by_position():
    # all advantages 0: every covariance is 0, k = max(1, int(4 * 0.5)) = 2 tokens get |lp - lp_old|.
    # verl 0.9.1 takes torch.topk's CPU order among the ties, an implementation detail (tokens 2 and 3 here
    # with torch 2.13; 5 and 6 of 8 tokens); mrl takes the earliest tokens, 0 and 1.
    lp = torch.zeros(1, 4, dtype=F64)
    pt, m = losses.kl_cov(lp, lp + 0.1, t([[0.0] * 4]), torch.ones(1, 4), ratio=0.5, kl_coef=1.0)
    torch.testing.assert_close(pt, t([[0.1, 0.1, 0.0, 0.0]]))
    assert float(m["klfrac"]) == 0.5


def test_cov_losses_clamp_the_log_ratio_at_20():
    # verl 0.9.1's clip_cov and kl_cov take exp(lp - lp_old) unclamped (its vanilla PPO clamps at +-20).
    # d = -25, A = -1: clip_cov (eps 0.2) -> max(-A r, -A clip(r)) = max(e^-20, 0.8) = 0.8 either way;
    # kl_cov -> -A r + |d| on the penalised token = e^-20 + 20 (verl: e^-25 + 25).
    lp = t([[-25.0]])
    pt, _ = losses.kl_cov(lp, t([[0.0]]), t([-1.0]), torch.ones(1, 1), ratio=1.0, kl_coef=1.0)
    torch.testing.assert_close(pt, t([[math.exp(-20.0) + 20.0]]))
    pt, _ = losses.clip_cov(lp, t([[0.0]]), t([-1.0]), torch.ones(1, 1), 0.2, 0.2, ratio=1.0)
    torch.testing.assert_close(pt, t([[0.8]]))


# ---------------------------------------------------------------------------- PF-PPO

def test_pf_ppo_weights():
    s = t([1.0, -2.0, 0.0])
    torch.testing.assert_close(rejection.pf_ppo_weights(s, "pow", 2.0), t([1.0, 4.0, 0.0]) + 1e-8)
    torch.testing.assert_close(rejection.pf_ppo_weights(s, "max_min"), t([1.0, 1.0, 0.0]) + 1e-8)
    torch.testing.assert_close(rejection.pf_ppo_weights(s, "max_random"), t([0.4, 0.1, 0.1]) + 1e-8)
    # nearly all mass on response 1: every draw takes it
    idx = rejection.pf_ppo_indices(t([0.0, 3.0, 0.0]), "pow", 2.0, generator=torch.Generator().manual_seed(0))
    assert idx.tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match="unknown PF-PPO"):
        rejection.pf_ppo_weights(s, "best")


def test_sum_pi_squared_of_the_logits(monkeypatch):
    # logits (0, ln 3) at temperature 1: pi = (1/4, 3/4), sum pi^2 = 10/16; temperature 2 halves them
    from mrl.engine import objectives

    monkeypatch.setattr(objectives, "_tp_group", lambda: None)

    class Rows:   # a micro-batch (no context parallelism) whose response rows are the logits themselves
        @staticmethod
        def take(x):
            return x

        @staticmethod
        def gather(x):
            return x

    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]])
    torch.testing.assert_close(objectives.sum_pi_squared(logits, Rows()), torch.tensor([10 / 16, 0.5]))
    p = torch.softmax(logits / 2, -1)
    torch.testing.assert_close(objectives.sum_pi_squared(logits, Rows(), 2.0), (p * p).sum(-1))
    # Megatron's vocabulary padding takes no mass
    padded = torch.tensor([[0.0, math.log(3.0), 5.0]])
    torch.testing.assert_close(objectives.sum_pi_squared(padded, Rows(), vocab_size=2), torch.tensor([10 / 16]))
