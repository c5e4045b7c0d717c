"""On-policy distillation's advantage (mrl.algos.advantages.distill) against hand values."""
from __future__ import annotations

import pytest
import torch

from mrl.algos import advantages as adv


def test_distill_advantage_is_the_negated_sampled_reverse_kl_per_token():
    old = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, -0.25, -3.0]])
    teacher = torch.tensor([[-0.5, -3.0, 9.0], [-0.5, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    a = adv.distill(old, teacher, mask, coef=2.0)
    assert a.tolist() == [[1.0, -2.0, 0.0], [0.0, 0.0, 4.0]]   # -2 (lp_old - lp_teacher)


def test_distill_mixes_the_task_advantage_with_its_weight():
    old = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]])
    teacher = torch.tensor([[-1.0, -1.0], [-2.0, -1.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    task = adv.grpo(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))   # +-0.7071 (unbiased std 0.7071)
    a = adv.distill(old, teacher, mask, 1.0, task, task_weight=0.5)
    t = 0.5 * float(task[0])
    assert a.flatten().tolist() == pytest.approx([t, 1.0 + t, -1.0 - t, 0.0], abs=1e-6)
