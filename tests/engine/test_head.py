"""`mrl.models.head.at_rows`: the output layer at chosen row positions only (in process; the
megatron models at DP2/TP2/PP2/CP2 are in tests/engine/scripts/head_rows_equivalence.py)."""
from __future__ import annotations

import pytest
import torch

from mrl.batch import Batch
from mrl.engine.packing import pack
from mrl.models.head import at_rows, output_layer


class Toy(torch.nn.Module):
    """megatron's shape conventions: hidden [T, 1, H] -> output layer -> [1, T, V]."""

    def __init__(self, post_process: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.post_process = post_process
        self.body = torch.nn.Linear(4, 4)
        self.output_layer = torch.nn.Linear(4, 6) if post_process else None
        self.calls = []

    def forward(self, x):                       # x [T, H]
        hidden = self.body(x).unsqueeze(1)      # [T, 1, H]
        if not self.post_process:
            return hidden
        out = self.output_layer(hidden)
        self.calls.append(out.shape[0])
        return out.transpose(0, 1)


class Wrapper(torch.nn.Module):   # DDP / Float16Module keep the model in `.module`
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


def test_the_head_runs_at_the_chosen_rows_with_the_whole_rows_values_and_gradients():
    model = Wrapper(Toy())
    x = torch.randn(7, 4)
    pos = torch.tensor([1, 2, 5])
    full = model(x)
    (full[0, pos] ** 2).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with at_rows(model, pos):
        got = model(x)
    assert got.shape == (1, 3, 6) and model.module.calls == [7, 3]   # the layer saw 3 rows
    torch.testing.assert_close(got, full[:, pos], rtol=0, atol=0)
    (got ** 2).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-6, atol=1e-7)
    assert model(x).shape == (1, 7, 6)   # outside the block: the whole row again


def test_the_selection_serves_one_call_and_a_stage_without_a_head_passes_through():
    model = Toy()
    x = torch.randn(5, 4)
    with at_rows(model, torch.tensor([0, 4])):
        assert model(x).shape == (1, 2, 6)
        assert model(x).shape == (1, 5, 6)   # the hook is spent on the forward it was set for
    stage = Toy(post_process=False)
    assert output_layer(stage) is None and output_layer(Wrapper(Wrapper(model))) is model.output_layer
    with at_rows(stage, torch.tensor([0])):
        assert stage(x).shape == (5, 1, 4)


def test_take_reads_a_head_at_rows_output_and_refuses_a_whole_row_one():
    b = Batch.from_sequences([[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10]])
    mb = pack(b, [0, 1])
    n, t = mb.response_positions.numel(), mb.row_tokens
    row = torch.arange(t, dtype=torch.float32).view(1, t, 1)
    assert mb.take(row)[:, 0].tolist() == mb.response_positions.float().tolist()
    mb.head_rows = True
    at = row[:, mb.response_positions]
    assert torch.equal(mb.take(at), at[0])
    with pytest.raises(ValueError, match="5 response positions"):
        mb.take(row)
