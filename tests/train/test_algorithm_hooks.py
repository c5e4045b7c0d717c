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


def _run(advantage, old_logprobs="recompute", rejection="token_k1", threshold="0.5_2.0"):
    from types import SimpleNamespace

    from mrl.algos.config import AlgorithmConfig, CorrectionConfig

    alg = AlgorithmConfig(advantage=advantage, gamma=1.0, correction=CorrectionConfig(
        rejection=rejection, rejection_threshold=threshold, old_logprobs=old_logprobs))
    return SimpleNamespace(spec=SimpleNamespace(algorithm=alg, job=SimpleNamespace(seed=0)), dp=1)


def _two_responses():
    # one group, 2 responses x 2 tokens, scores (1, 0); lp_old - lp_roll = 1 on response 0's last token:
    # token_k1 with 0.5_2.0 rejects it (-1 < log 0.5)
    b = Batch.from_sequences([[1, 2]] * 2, [[5, 6], [7, 8]], group_index=[0, 0])
    trainer = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    return b.add(trainer_logprobs=trainer, rollout_logprobs=torch.zeros(2, 2), old_logprobs=trainer,
                 rewards=torch.tensor([1.0, 0.0]))


def test_rejection_comes_before_the_advantages_as_in_verl():
    """verl 0.9.1's trainers (ray_trainer.fit, v1 trainer_base._compute_advantage) apply rollout_rs to the
    response mask before compute_advantage; the score stays on the last generated token."""
    from mrl.train.step import advantages

    # REINFORCE++, gamma 1: response 0's score sits on its rejected token, which passes no return: all
    # returns are 0 -> verl's compute_reinforce_plus_plus_outcome_advantage gives all 0 (rejecting after: +-0.87)
    out, metrics = advantages(_run("reinforce_pp"), None, _two_responses())
    assert out["response_mask"].tolist() == [[1, 0], [1, 1]]
    assert out["advantages"].tolist() == [[0.0, 0.0], [0.0, 0.0]]
    assert metrics["correction/rejection/masked_fraction"] == 0.25
    # REINFORCE++-baseline: (0.5, -0.5) on the 3 kept tokens, mean -1/6, unbiased var 1/3 -> verl
    # compute_reinforce_plus_plus_baseline_outcome_advantage: 1.1547, -0.5774, -0.5774
    out, _ = advantages(_run("reinforce_pp_baseline"), None, _two_responses())
    torch.testing.assert_close(out["advantages"], torch.tensor([[2 / 3 ** 0.5, 0.0], [-1 / 3 ** 0.5, -1 / 3 ** 0.5]]))
    # OPO: lengths 1 and 2 -> baseline (1 * 1 + 2 * 0) / 3 = 1/3 -> verl compute_opo_outcome_advantage 2/3, -1/3
    out, _ = advantages(_run("opo"), None, _two_responses())
    torch.testing.assert_close(out["advantages"], torch.tensor([[2 / 3, 0.0], [-1 / 3, -1 / 3]]))


def test_bypass_mode_rejects_after_the_advantages_as_in_verl():
    """verl 0.9.1's bypass mode skips the trainer's rejection and rejects inside the loss
    (compute_policy_loss_bypass_mode), so its advantages see the response mask as generated."""
    from mrl.train.step import advantages

    out, _ = advantages(_run("reinforce_pp", old_logprobs="rollout"), None, _two_responses())
    # returns (1, 1) and (0, 0): mean 0.5, unbiased var 1/3 -> +-0.8660, then the mask rejects one token
    torch.testing.assert_close(out["advantages"], torch.tensor([[0.5, 0.5], [-0.5, -0.5]]) * 3 ** 0.5, atol=1e-6,
                               rtol=0)
    assert out["response_mask"].tolist() == [[1, 0], [1, 1]]
    assert out["unrejected_mask"].tolist() == [[1, 1], [1, 1]]


def test_pf_ppo_resamples_with_a_group_estimator_too():
    """verl 0.9.1 resamples (compute_pf_ppo_reweight_data) only in compute_advantage's gae branch and
    ignores use_pf_ppo otherwise; mrl resamples with every estimator (docs/algorithms.md)."""
    from types import SimpleNamespace

    from mrl.algos.config import AlgorithmConfig, PFPPOConfig
    from mrl.train.step import advantages

    run = SimpleNamespace(spec=SimpleNamespace(algorithm=AlgorithmConfig(advantage="grpo", pf_ppo=PFPPOConfig(enable=True)),
                                               job=SimpleNamespace(seed=0)), dp=1)
    b, _ = _batch()
    out, _ = advantages(run, None, Batch({k: v for k, v in b.tensors.items() if k != "advantages"}, b.meta))
    # |score|^2 puts nearly all weight on response 1 (score 3): every row is a copy of it, with its GRPO
    # advantage (3 - 1.5) / (std(0, 3) + 1e-6) = 0.7071
    assert out["rewards"].tolist() == [3.0] * 4
    torch.testing.assert_close(out["advantages"], torch.full((4, 2), 1.5 / 4.5 ** 0.5), atol=1e-5, rtol=0)
