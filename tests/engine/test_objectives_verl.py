"""The actor objective's wiring of two verl 0.9.1 conventions, on a hand-made micro-batch (no model):
GMPO's mean over every row, and bypass REINFORCE's IS weights over the response before rejection."""
import math
from types import SimpleNamespace

import torch

from mrl.batch import Batch
from mrl.engine import objectives
from mrl.engine.engine import Totals


def _micro_batch(logp, **fields):
    n, r = logp.shape
    base = Batch.from_sequences([[1]] * n, [[2] * r] * n, group_index=list(range(n)))
    batch = Batch({**base.tensors, **fields}, base.meta)
    return SimpleNamespace(batch=batch, to_padded=lambda x: x, loss_tokens=int((fields["response_mask"] > 0).sum()))


def _call(monkeypatch, objective, logp, mb, rows):
    # the "logits" are the log-probs themselves; entropy 0
    monkeypatch.setattr(objectives, "response_logprobs", lambda logits, mb, *a, **k: (logits, torch.zeros_like(logits)))
    mask = mb.batch["response_mask"] > 0
    totals = Totals(tokens=mask.sum().double(), sequences=(mask.sum(-1) > 0).sum().double(), dp_size=1,
                    rows=torch.tensor(float(rows), dtype=torch.float64))
    return objective(logp, mb, totals)


def test_geo_mean_divides_by_every_row(monkeypatch):
    # verl 0.9.1 compute_policy_loss_geo_mean: torch.mean over the rows. Row 1 fully masked (rejected), A = 1,
    # lp = lp_old: losses (-1, 0) -> -0.5 (the mean over non-empty rows would be -1)
    logp = torch.zeros(2, 1, requires_grad=True)
    mb = _micro_batch(logp, response_mask=torch.tensor([[1], [0]]), old_logprobs=torch.zeros(2, 1),
                      advantages=torch.ones(2, 1))
    loss, metrics = _call(monkeypatch, objectives.PolicyObjective(loss="geo_mean"), logp, mb, rows=2)
    torch.testing.assert_close(loss, torch.tensor(-0.5))
    torch.testing.assert_close(metrics["pg_loss"], torch.tensor(-0.5, dtype=torch.float64))


def test_bypass_reinforce_weights_span_the_response_before_rejection(monkeypatch):
    # lp - lp_roll = (0, 0.5), token 1 rejected (token_k2 at 0.01): the sequence weight is exp(0.5), as verl
    # 0.9.1's compute_policy_loss_bypass_mode; token-mean over the one kept token -> d loss / d lp_0 = -1.6487
    roll = torch.log(torch.tensor([[0.5, 0.5]]))
    logp = (roll + torch.tensor([[0.0, 0.5]])).requires_grad_(True)
    mb = _micro_batch(logp, response_mask=torch.tensor([[1, 0]]), unrejected_mask=torch.tensor([[1, 1]]),
                      old_logprobs=roll, advantages=torch.ones(1, 2))
    obj = objectives.PolicyObjective(loss="reinforce", is_level="sequence", is_threshold=2.0)
    loss, metrics = _call(monkeypatch, obj, logp, mb, rows=1)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-math.exp(0.5), 0.0]]))
    torch.testing.assert_close(metrics["pg_is_weight_mean"], torch.tensor(math.exp(0.5)))
