"""The training step's rejection-sampling and PF-PPO hooks on a hand-made batch (no processes)."""
import torch

from mrl.batch import Batch
from mrl.train.step import pf_ppo, reject


def _batch():
    b = Batch.from_sequences([[1, 2]] * 4, [[5, 6], [5, 6], [7, 8], [7, 8]], group_index=[0, 0, 1, 1])
    mask = b["response_mask"].float()
    # lp_old - lp_roll: response 1 has a token at -1 (rejected by token_k1 with 0.5_2), others 0
    roll = torch.zeros(4, 2)
    trainer = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    return b.add(trainer_logprobs=trainer, rollout_logprobs=roll, rewards=torch.tensor([0.0, 3.0, 0.0, 0.0]),
                 advantages=torch.ones(4, 2)), mask


def test_reject_takes_rejected_tokens_out_of_the_response_mask():
    b, mask = _batch()
    out, metrics = reject(b, "token_k1", "0.5_2")
    assert out["response_mask"].tolist() == [[1, 1], [0, 1], [1, 1], [1, 1]]
    assert torch.equal(out["unrejected_mask"], b["response_mask"])
    assert metrics["correction/rejection/masked_fraction"] == 1 / 8
    assert metrics["correction/rejection/seq_masked_fraction"] == 1 / 4
    out, _ = reject(b, "seq_sum_k1", "0.5_2")   # the whole response goes
    assert out["response_mask"].tolist() == [[1, 1], [0, 0], [1, 1], [1, 1]]


def test_pf_ppo_resamples_rows_and_regroups_them():
    b, _ = _batch()
    cfg = type("Cfg", (), {"method": "pow", "weight_pow": 2.0})
    out = pf_ppo(b, cfg, seed=(1, 2, 0))
    # nearly all weight on response 1 (score 3): every row is a copy of it
    assert out["rewards"].tolist() == [3.0] * 4
    assert out["group_index"].tolist() == [0, 0, 1, 1]
