"""Advantage estimators on values small enough to check on paper (float64 throughout)."""
import math

import pytest
import torch

from mrl.algos import advantages as adv

F64 = torch.float64


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


# ----------------------------------------------------------------------------------------- GAE
def test_gae_multi_turn_observation_passes_value_and_advantage_through():
    # one response, token 2 is a tool observation (m = 0): its reward 5 and value 9 are ignored.
    # gamma = lam = 0.5, gamma*lam = 0.25. Backwards:
    #   t3: delta = 1 + 0.5*0 - 2 = -1              A3 = -1,                 V_next := 2
    #   t2: masked                                  A stays -1,              V_next stays 2
    #   t1: delta = 0 + 0.5*2 - 1 = 0               A1 = 0 + 0.25*(-1) = -0.25, V_next := 1
    #   t0: delta = 0 + 0.5*1 - 0.5 = 0             A0 = 0 + 0.25*(-0.25) = -0.0625
    # returns = A + V on valid tokens: [0.4375, 0.75, -, 1.0]
    rewards = t([[0.0, 0.0, 5.0, 1.0]])
    values = t([[0.5, 1.0, 9.0, 2.0]])
    mask = t([[1, 1, 0, 1]])
    raw, returns = adv.gae(rewards, values, mask, 0.5, 0.5, whiten=False)
    assert raw.tolist() == [[-0.0625, -0.25, 0.0, -1.0]]
    assert returns.tolist() == [[0.4375, 0.75, 0.0, 1.0]]

    # whitened over {-0.0625, -0.25, -1}: mean = -1.3125/3 = -0.4375,
    # deviations 0.375, 0.1875, -0.5625; sum of squares 0.140625+0.03515625+0.31640625 = 0.4921875,
    # unbiased var = 0.4921875/2 = 0.24609375; A = dev * rsqrt(var + 1e-8)
    whitened, returns2 = adv.gae(rewards, values, mask, 0.5, 0.5)
    scale = 1.0 / math.sqrt(0.24609375 + 1e-8)
    expected = t([[0.375 * scale, 0.1875 * scale, 0.0, -0.5625 * scale]])
    torch.testing.assert_close(whitened, expected, rtol=1e-14, atol=0)
    assert returns2.tolist() == returns.tolist()  # returns use A before whitening


def test_gae_gamma_one_lam_one_is_reward_to_go_minus_value():
    # gamma = lam = 1: A_t = sum_{t'>=t} r_t' - V_t (telescoping); rewards [1,2,3], V [1,1,1]:
    # A = [6-1, 5-1, 3-1] = [5, 4, 2]
    raw, ret = adv.gae(t([[1.0, 2.0, 3.0]]), t([[1.0, 1.0, 1.0]]), t([[1, 1, 1]]), 1.0, 1.0, whiten=False)
    assert raw.tolist() == [[5.0, 4.0, 2.0]]
    assert ret.tolist() == [[6.0, 5.0, 3.0]]


def _gae_reference(rewards, values, mask, gamma, lam):
    """Plain transcription of the recurrence in docs/algorithms.md with float masks (verl's form)."""
    b, n = rewards.shape
    next_v = torch.zeros(b, dtype=F64)
    last = torch.zeros(b, dtype=F64)
    out = torch.zeros_like(rewards)
    for i in reversed(range(n)):
        m = mask[:, i]
        delta = rewards[:, i] + gamma * next_v - values[:, i]
        cand = delta + gamma * lam * last
        next_v = values[:, i] * m + (1 - m) * next_v
        last = cand * m + (1 - m) * last
        out[:, i] = last
    return out


def test_gae_matches_reference_recurrence_on_random_batch():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(5, 9, generator=g, dtype=F64)
    values = torch.randn(5, 9, generator=g, dtype=F64)
    mask = (torch.rand(5, 9, generator=g) > 0.3).to(F64)
    mask[4] = 0  # a fully masked row
    raw, ret = adv.gae(rewards, values, mask, 0.9, 0.8, whiten=False)
    ref = _gae_reference(rewards, values, mask, 0.9, 0.8)
    torch.testing.assert_close(raw, ref * mask, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(ret, (ref + values) * mask, rtol=1e-13, atol=1e-13)
    white, _ = adv.gae(rewards, values, mask, 0.9, 0.8)
    sel = mask.bool()
    x = ref[sel]
    expected = (x - x.mean()) * torch.rsqrt(x.var(unbiased=True) + 1e-8)
    torch.testing.assert_close(white[sel], expected, rtol=1e-12, atol=1e-12)
    assert (white[~sel] == 0).all()


def test_gae_fully_masked_batch_gives_zeros_not_nan():
    a, r = adv.gae(t([[1.0, 2.0]]), t([[0.5, 0.5]]), t([[0, 0]]), 1.0, 0.95)
    assert a.tolist() == [[0.0, 0.0]] and r.tolist() == [[0.0, 0.0]]


def test_gae_single_valid_token_whitens_to_zero():
    # verl raises on one valid token (unbiased variance undefined); mrl returns 0
    a, r = adv.gae(t([[3.0, 0.0]]), t([[1.0, 0.0]]), t([[1, 0]]), 1.0, 1.0)
    assert a.tolist() == [[0.0, 0.0]] and r.tolist() == [[3.0, 0.0]]


# ---------------------------------------------------------------------------------------- GRPO
SCORES = [1.0, 0.0, 0.0, 1.0, 1.0, 0.25]
GROUPS = [5, 2, 5, 2, 5, 9]  # arbitrary, unsorted ids; group 9 has one response


def test_grpo_hand_values():
    # group 5 = rows 0,2,4 scores [1,0,1]: mean 2/3, devs [1/3,-2/3,1/3], ssd 6/9, var 1/3, std 1/sqrt(3)
    # group 2 = rows 1,3 scores [0,1]: mean 1/2, devs [-1/2,1/2], ssd 1/2, var 1/2, std 1/sqrt(2)
    # group 9 = row 5 alone: mean 0, std 1 -> 0.25 / (1 + 1e-6)
    a = adv.grpo(t(SCORES), torch.tensor(GROUPS))
    s5, s2 = 1 / math.sqrt(3) + 1e-6, 1 / math.sqrt(2) + 1e-6
    expected = t([(1 / 3) / s5, -0.5 / s2, (-2 / 3) / s5, 0.5 / s2, (1 / 3) / s5, 0.25 / (1 + 1e-6)])
    torch.testing.assert_close(a, expected, rtol=1e-14, atol=0)


def test_dr_grpo_no_std_division():
    a = adv.grpo(t(SCORES), torch.tensor(GROUPS), norm_by_std=False)
    torch.testing.assert_close(a, t([1 / 3, -0.5, -2 / 3, 0.5, 1 / 3, 0.25]), rtol=1e-15, atol=0)


def test_grpo_all_equal_group_is_exactly_zero_even_with_rounding():
    # three (float32) 0.1 scores: a naive mean/std leaves rounding residue; here exactly 0
    s = torch.tensor([0.1, 0.1, 0.1, 0.3, 0.7], dtype=torch.float32)
    g = torch.tensor([4, 4, 4, 1, 1])
    a = adv.grpo(s, g)
    assert a.dtype == torch.float32
    assert a[:3].tolist() == [0.0, 0.0, 0.0]
    assert adv.grpo(s, g, norm_by_std=False)[:3].tolist() == [0.0, 0.0, 0.0]


def test_grpo_empty_batch():
    assert adv.grpo(t([]), torch.tensor([], dtype=torch.long)).shape == (0,)


# ---------------------------------------------------------------------------------------- RLOO
def test_rloo_hand_values():
    # group 5 [1,0,1]: 1 - mean(0,1) = 0.5; 0 - mean(1,1) = -1; 1 - mean(1,0) = 0.5
    # group 2 [0,1]: 0 - 1 = -1; 1 - 0 = 1; group 9 (one response): 0 by definition
    a = adv.rloo(t(SCORES), torch.tensor(GROUPS))
    torch.testing.assert_close(a, t([0.5, -1.0, -1.0, 1.0, 0.5, 0.0]), rtol=1e-15, atol=1e-15)


# --------------------------------------------------------------------------------- REINFORCE++
def test_reinforce_pp_discounted_return_passes_through_observation_then_whitens():
    # gamma = 0.5
    # row 0 mask [1,1,0,1], rewards [0,1,7,2]: t3 G=2; t2 masked, G stays 2 (reward 7 ignored);
    #   t1 G = 1 + 0.5*2 = 2; t0 G = 0 + 0.5*2 = 1            -> [1, 2, -, 2]
    # row 1 mask [1,1,1,0], rewards [0,0,4,0]: t2 G=4; t1 2; t0 1 -> [1, 2, 4, -]
    # valid G: 1,2,2,1,2,4; mean 12/6 = 2; devs -1,0,0,-1,0,2; ssd 6; unbiased var 6/5 = 1.2
    rewards = t([[0.0, 1.0, 7.0, 2.0], [0.0, 0.0, 4.0, 0.0]])
    mask = t([[1, 1, 0, 1], [1, 1, 1, 0]])
    a = adv.reinforce_pp(rewards, mask, 0.5)
    s = 1.0 / math.sqrt(1.2 + 1e-8)
    expected = t([[-s, 0.0, 0.0, 0.0], [-s, 0.0, 2 * s, 0.0]])
    torch.testing.assert_close(a, expected, rtol=1e-14, atol=1e-15)


def test_reinforce_pp_baseline_hand_values():
    # scores [1, 0, 1.5], groups [4, 4, 8]: group 4 mean 0.5 -> +0.5, -0.5; group 8 alone (mean 0) -> 1.5
    # token values (mask rows [1,1,0], [1,0,0], [1,0,0]): 0.5, 0.5, -0.5, 1.5
    # mean 2/4 = 0.5; devs 0, 0, -1, 1; ssd 2; unbiased var 2/3
    mask = t([[1, 1, 0], [1, 0, 0], [1, 0, 0]])
    a = adv.reinforce_pp_baseline(t([1.0, 0.0, 1.5]), torch.tensor([4, 4, 8]), mask)
    s = 1.0 / math.sqrt(2 / 3 + 1e-8)
    expected = t([[0.0, 0.0, 0.0], [-s, 0.0, 0.0], [s, 0.0, 0.0]])
    torch.testing.assert_close(a, expected, rtol=1e-14, atol=1e-15)


# --------------------------------------------------------------------------------------- ReMax
def test_remax_reward_to_go_minus_greedy_score():
    # row 0 mask [1,0,1], rewards [1,5,2] (5 on a masked token: ignored), greedy 0.5:
    #   to-go [3, -, 2] -> [2.5, 0, 1.5]
    # row 1 mask [1,1,0], rewards [0,1,0], greedy 2: to-go [1,1,-] -> [-1, -1, 0]
    rewards = t([[1.0, 5.0, 2.0], [0.0, 1.0, 0.0]])
    mask = t([[1, 0, 1], [1, 1, 0]])
    a = adv.remax(rewards, t([0.5, 2.0]), mask)
    assert a.tolist() == [[2.5, 0.0, 1.5], [-1.0, -1.0, 0.0]]


# ------------------------------------------------------------------------------- token rewards
def test_token_rewards_score_on_last_valid_token_and_kl_in_reward():
    # last valid tokens: row 0 -> 1, row 1 -> 2 (after a masked observation), row 2 -> none
    # beta = 0.5: subtract 0.5*kl on valid tokens only
    mask = t([[1, 1, 0], [1, 0, 1], [0, 0, 0]])
    kl = t([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9]])
    r = adv.token_rewards(t([2.0, 3.0, 4.0]), mask, kl=kl, beta=0.5)
    expected = t([[-0.05, 2.0 - 0.1, 0.0], [-0.2, 0.0, 3.0 - 0.3], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(r, expected, rtol=1e-15, atol=1e-15)
    assert adv.token_rewards(t([2.0, 3.0, 4.0]), mask).tolist() == [[0, 2, 0], [0, 0, 3], [0, 0, 0]]


def test_shape_errors():
    with pytest.raises(ValueError):
        adv.gae(t([[1.0]]), t([[1.0, 2.0]]), t([[1, 1]]), 1.0, 1.0)
    with pytest.raises(ValueError):
        adv.grpo(t([1.0, 2.0]), torch.tensor([1]))
    with pytest.raises(ValueError):
        adv.remax(t([[1.0]]), t([1.0, 2.0]), t([[1]]))


def test_empty_batches_and_integer_inputs():
    e = torch.zeros(0, 4)
    assert adv.gae(e, e, e, 1.0, 1.0)[0].shape == (0, 4)
    assert adv.reinforce_pp(e, e, 1.0).shape == (0, 4)
    assert adv.remax(e, torch.zeros(0), e).shape == (0, 4)
    assert adv.rloo(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)
    z = torch.zeros(2, 0)
    assert adv.gae(z, z, z, 1.0, 1.0)[1].shape == (2, 0)
    assert adv.token_rewards(torch.ones(2), z).shape == (2, 0)
    # integer scores (0/1 accuracy) and a bool mask
    a = adv.grpo(torch.tensor([1, 0]), torch.tensor([3, 3]), norm_by_std=False)
    assert a.dtype == torch.get_default_dtype() and a.tolist() == [0.5, -0.5]
    b = adv.reinforce_pp_baseline(torch.tensor([1, 0]), torch.tensor([3, 3]), torch.tensor([[True], [True]]))
    assert b.dtype == torch.get_default_dtype()
