"""Pure pieces: the processed distribution, the audit metrics, bucketing, sampling from config."""
from __future__ import annotations

import math

import pytest
import torch

from mrl.rollout.audit import logprob_audit
from mrl.rollout.engine import buckets
from mrl.rollout.logprobs import process_logits, reported_logprobs
from mrl.rollout.types import Sampling, sampling_from_config

LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))


def _kept(z):
    return torch.isfinite(z)[0].tolist()


def test_top_k_top_p_min_p_cut_and_renormalise():
    assert _kept(process_logits(LOGITS, Sampling(top_k=2))) == [True, True, False, False]
    # top-p keeps the smallest prefix with mass >= p (0.5 alone reaches 0.5; 0.75 needs two)
    assert _kept(process_logits(LOGITS, Sampling(top_p=0.5))) == [True, False, False, False]
    assert _kept(process_logits(LOGITS, Sampling(top_p=0.7))) == [True, True, False, False]
    assert _kept(process_logits(LOGITS, Sampling(min_p=0.3))) == [True, True, False, False]
    lp = reported_logprobs(LOGITS, torch.tensor([1]), Sampling(top_k=2))
    assert lp.item() == pytest.approx(math.log(0.25 / 0.75), abs=1e-6)
    raw = reported_logprobs(LOGITS, torch.tensor([1]), Sampling(top_k=2, temperature=0.5, logprobs_mode="raw_logprobs"))
    assert raw.item() == pytest.approx(math.log(0.25), abs=1e-6)


def test_temperature_and_greedy():
    t = reported_logprobs(LOGITS, torch.tensor([0]), Sampling(temperature=0.5)).item()
    assert t == pytest.approx(math.log(0.25 / (0.25 + 0.0625 + 2 * 0.015625)), abs=1e-6)  # p^2 renormalised
    g = reported_logprobs(LOGITS, torch.tensor([0]), Sampling(temperature=0.0)).item()
    assert g == pytest.approx(math.log(0.5), abs=1e-6)  # greedy reports the temperature-1 distribution


def test_repetition_penalty_follows_vllm():
    z = torch.tensor([[2.0, -2.0, 1.0]])
    seen = torch.tensor([[True, True, False]])
    out = process_logits(z, Sampling(temperature=1.0, repetition_penalty=2.0), seen)
    assert out.tolist() == [[1.0, -4.0, 1.0]]


def test_audit_metrics_by_hand():
    roll = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]])
    train = torch.tensor([[-1.1, -2.0, -2.5], [-0.5, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    m = logprob_audit(roll, train, mask)
    d = torch.tensor([0.1, 0.0, -0.5, 0.0], dtype=torch.float64)
    assert m["rollout/audit_tokens"] == 4
    assert m["rollout/logprob_abs_diff_mean"] == pytest.approx(0.15)
    assert m["rollout/logprob_abs_diff_max"] == pytest.approx(0.5)
    assert m["rollout/kl_k1"] == pytest.approx(float(d.mean()))
    assert m["rollout/kl_k3"] == pytest.approx(float((torch.exp(-d) - 1 + d).mean()))
    assert m["rollout/kl_k3"] > 0
    # sequences: row 0 mean d = (0.1 + 0 - 0.5) / 3, row 1 mean d = 0; log-ppl diff is their mean
    assert m["rollout/log_ppl_diff"] == pytest.approx((-0.4 / 3 + 0.0) / 2)
    assert m["rollout/log_ppl_abs_diff"] == pytest.approx((0.4 / 3) / 2)
    # chi^2 per token: mean of (pi_trainer / pi_rollout)^2 - 1 = mean exp(-2d) - 1
    assert m["rollout/chi2_token"] == pytest.approx(float(torch.exp(-2 * d).mean() - 1))
    assert m["rollout/chi2_seq"] == pytest.approx(float((torch.exp(torch.tensor(0.8)) + 1) / 2 - 1))
    same = logprob_audit(roll, roll.clone(), mask)
    assert same["rollout/logprob_abs_diff_max"] == 0 and same["rollout/kl_k3"] == 0
    assert same["rollout/chi2_token"] == 0 and same["rollout/log_ppl_diff"] == 0
    assert logprob_audit(roll, train, torch.zeros_like(mask))["rollout/kl_k1"] == 0
    with pytest.raises(ValueError, match="shapes"):
        logprob_audit(roll, train[:, :2], mask)


def test_buckets_respect_the_size_bound():
    mib = 2**20 // 4  # fp32 elements per MiB
    stream = [("a", torch.zeros(mib)), ("b", torch.zeros(mib)), ("c", torch.zeros(3 * mib)), ("d", torch.zeros(1))]
    assert [[n for n, _ in b] for b in buckets(stream, 2)] == [["a", "b"], ["c"], ["d"]]
    assert [[n for n, _ in b] for b in buckets(iter(stream), 100)] == [["a", "b", "c", "d"]]


def test_sampling_from_config():
    from mrl.rollout.config import RolloutConfig

    cfg = RolloutConfig(responses_per_prompt=4, temperature=0.7, top_p=0.9, max_response_tokens=64,
                        stop_token_ids=(7,), logprobs_mode="raw_logprobs")
    s = sampling_from_config(cfg, seed=3)
    assert (s.n, s.temperature, s.top_p, s.max_tokens, s.stop_token_ids, s.seed, s.logprobs_mode) == \
        (4, 0.7, 0.9, 64, (7,), 3, "raw_logprobs")
    v = sampling_from_config(cfg, validation=True)
    assert v.greedy and v.n == 1
    with pytest.raises(ValueError):
        Sampling(top_k=0)
