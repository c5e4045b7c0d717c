"""Online DPO's pure functions (mrl.algos.dpo) against hand-computed values (docs/algorithms.md)."""
from __future__ import annotations

import math

import pytest
import torch

from mrl.algos import dpo


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_best_worst_pairs_one_per_group_and_drops_groups_without_preference():
    scores = torch.tensor([0.0, 1.0, 0.5, 0.2, 0.2, 0.2, 1.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    chosen, rejected, dropped = dpo.preference_pairs(scores, groups)
    assert chosen.tolist() == [1, 6] and rejected.tolist() == [0, 8] and dropped == 1   # ties: first row
    chosen, rejected, dropped = dpo.preference_pairs(scores, groups, "best_worst", margin=1.0)
    assert chosen.tolist() == [] and dropped == 3   # a difference of exactly the margin is no preference


def test_margin_pairs_every_ordered_pair_above_the_margin():
    scores = torch.tensor([0.0, 1.0, 0.5, 3.0, 3.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    chosen, rejected, dropped = dpo.preference_pairs(scores, groups, "margin", margin=0.0)
    assert list(zip(chosen.tolist(), rejected.tolist())) == [(1, 0), (1, 2), (2, 0)] and dropped == 1
    chosen, rejected, _ = dpo.preference_pairs(scores, groups, "margin", margin=0.6)
    assert list(zip(chosen.tolist(), rejected.tolist())) == [(1, 0)]


def test_sequence_logps_sum_over_the_mask_ignoring_padding_values():
    logp = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert dpo.sequence_logps(logp, mask).tolist() == [-3.0, -0.5]


SEQ = torch.tensor([-3.0, -5.0, -2.0, -4.0])
REF = torch.tensor([-3.5, -4.0, -2.5, -3.0])
LEN = torch.tensor([3, 5, 2, 4])
CHOSEN, REJECTED = torch.tensor([0, 2]), torch.tensor([1, 3])


def test_dpo_loss_and_coefficients_equal_hand_values():
    beta, total = 0.1, 4.0   # two local pairs of four over every rank
    coef, share, m = dpo.row_coefficients(SEQ, REF, LEN, CHOSEN, REJECTED, total, "dpo", beta)
    h = [(-3.0 + 3.5) - (-5.0 + 4.0), (-2.0 + 2.5) - (-4.0 + 3.0)]   # 1.5, 1.5
    losses = [-math.log(_sig(beta * x)) for x in h]
    assert share.tolist() == pytest.approx([losses[0] / total, 0.0, losses[1] / total, 0.0], abs=1e-7)
    g = [beta * (1 - _sig(beta * x)) / total for x in h]   # d(-log sig(beta h))/dh = -beta sig(-beta h)
    assert coef.tolist() == pytest.approx([-g[0], g[0], -g[1], g[1]], abs=1e-7)
    assert float(m["loss"]) == pytest.approx(sum(losses), abs=1e-7)
    assert float(m["reward_margin"]) == pytest.approx(beta * sum(h), abs=1e-7)
    assert float(m["reward_accuracy"]) == 2.0
    assert float(m["chosen_logp"]) == -5.0 and float(m["rejected_logp"]) == -9.0


def test_ipo_loss_and_coefficients_equal_hand_values():
    beta = 0.5
    coef, share, m = dpo.row_coefficients(SEQ, REF, LEN, CHOSEN, REJECTED, 2.0, "ipo", beta)
    h = 1.5
    assert float(m["loss"]) == pytest.approx(2 * (h - 1.0) ** 2)
    d = 2 * (h - 1.0) / 2.0
    assert coef.tolist() == pytest.approx([d, -d, d, -d])


def test_simpo_is_length_normalised_and_reference_free():
    beta, gamma = 2.0, 0.5
    coef, share, m = dpo.row_coefficients(SEQ, None, LEN, CHOSEN, REJECTED, 2.0, "simpo", beta, gamma)
    z = [beta * (-3.0 / 3 - -5.0 / 5) - gamma, beta * (-2.0 / 2 - -4.0 / 4) - gamma]   # both -0.5
    assert float(m["loss"]) == pytest.approx(sum(-math.log(_sig(x)) for x in z))
    g = [beta * (1 - _sig(x)) / 2.0 for x in z]
    assert coef.tolist() == pytest.approx([-g[0] / 3, g[0] / 5, -g[1] / 2, g[1] / 4])
    assert float(m["reward_accuracy"]) == 0.0   # equal per-token log-probs: no margin
    assert not dpo.uses_reference("simpo") and dpo.uses_reference("ipo")


def test_a_row_in_several_pairs_sums_its_coefficients_and_no_pairs_give_zero():
    seq, ref, n = torch.tensor([-1.0, -2.0, -3.0]), torch.zeros(3), torch.ones(3, dtype=torch.long)
    coef, _, _ = dpo.row_coefficients(seq, ref, n, torch.tensor([0, 0]), torch.tensor([1, 2]), 2.0, "dpo", 1.0)
    g1, g2 = (1 - _sig(1.0)) / 2, (1 - _sig(2.0)) / 2
    assert coef.tolist() == pytest.approx([-(g1 + g2), g1, g2])
    coef, share, m = dpo.row_coefficients(seq, ref, n, torch.tensor([], dtype=torch.long),
                                          torch.tensor([], dtype=torch.long), 0.0, "dpo", 1.0)
    assert coef.tolist() == [0.0] * 3 and share.tolist() == [0.0] * 3 and float(m["loss"]) == 0.0
