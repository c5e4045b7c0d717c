"""DAPO overlong penalty and dynamic-sampling group filter."""
import pytest
import torch

from mrl.algos import dapo


def test_overlong_penalty_hand_values():
    # max_len 20, buffer 4: expected length 16; exceed = len - 16 = [-6, 0, 1, 4, 6]
    # -exceed/4*factor, capped at 0: factor 1 -> [0, 0, -0.25, -1, -1.5]; factor 0.5 -> halves
    lengths = torch.tensor([10, 16, 17, 20, 22])
    assert dapo.overlong_penalty(lengths, 20, 4, 1.0).tolist() == [0.0, 0.0, -0.25, -1.0, -1.5]
    assert dapo.overlong_penalty(lengths, 20, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.5, -0.75]
    assert dapo.overlong_penalty(lengths, 20, 4, 1.0).dtype == torch.float32


def test_overlong_penalty_published_recipe():
    # DAPO recipe: max 20480 tokens with a 4096-token buffer; 18432 tokens is half-way -> -0.5
    assert dapo.overlong_penalty(torch.tensor([16384, 18432, 20480]), 20480, 4096, 1.0).tolist() == [0.0, -0.5, -1.0]


def test_overlong_penalty_validates_buffer():
    with pytest.raises(ValueError):
        dapo.overlong_penalty(torch.tensor([1]), 20, 0, 1.0)
    with pytest.raises(ValueError):
        dapo.overlong_penalty(torch.tensor([1]), 20, 21, 1.0)


SCORES = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.5])
GROUPS = torch.tensor([30, 30, 8, 8, 5, 7])  # 30 mixed; 8 all equal; 5 and 7 single responses


def test_keep_groups():
    assert dapo.keep_groups(SCORES, GROUPS).tolist() == [True, True, False, False, False, False]
    # verl's DAPO trainer keeps singleton groups: available as an option
    assert dapo.keep_groups(SCORES, GROUPS, keep_singletons=True).tolist() == [True, True, False, False, True, True]


def test_keep_groups_exact_equality_not_rounded_std():
    # np.std([0.1, 0.1, 0.1]) is 1.4e-17 > 0 (verl would keep this group); max == min drops it
    s = torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64)
    assert dapo.keep_groups(s, torch.tensor([1, 1, 1])).tolist() == [False, False, False]


def test_group_keep_metrics():
    m = dapo.group_keep_metrics(SCORES, GROUPS)
    assert m["num_groups"].item() == 4 and m["num_groups_kept"].item() == 1
    assert m["kept_group_fraction"].item() == 0.25
    e = dapo.group_keep_metrics(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert e["num_groups"].item() == 0 and e["kept_group_fraction"].item() == 0.0
