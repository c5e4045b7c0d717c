"""Weighted composition of sources, the job's source list and its checks, and the reward-model path."""
import math
from pathlib import Path

import pytest

from mrl.errors import UserError
from mrl.reward.compose import Rewarder, RewardSample
from mrl.reward.config import RewardConfig
from mrl.reward.model import RewardModelScorer, micro_batches
from mrl.reward.sources import RewardSource, reward_problems, reward_sources

FUNCS = str(Path(__file__).with_name("user_rewards.py"))


def test_weighted_sum_of_rule_and_model_sources():
    seen = []

    def forward(batch):  # a fake scalar-head reward model: score = number of tokens / 10
        seen.append([len(s) for s in batch])
        return [len(s) / 10 for s in batch]

    cfg = RewardConfig(sources=(
        {"name": "correct", "function": f"{FUNCS}:correct", "weight": 1.0},
        {"name": "boxed", "builtin": "format_boxed", "weight": 0.5},
        {"name": "rm", "model_path": "/models/rm", "weight": -2.0},
        {"name": "half", "function": f"{FUNCS}:half", "weight": 1.0, "kwargs": {"bonus": 0.25}},
    ), workers=2, timeout_s=10)
    samples = [RewardSample("a", "q", "ok", "ok", token_ids=[1, 2, 3]),
               RewardSample("b", "q", "\\boxed{1}", "ok", token_ids=[1] * 5)]
    with Rewarder.from_config(cfg, model_scorer=RewardModelScorer(forward)) as r:
        res = r.score(samples)
    # a: 1*1 + 0.5*0 - 2*0.3 + 0.75 = 1.15 ; b: 1*0 + 0.5*1 - 2*0.5 + 0.75 = 0.25
    assert res.scores == pytest.approx([1.15, 0.25])
    assert res.source_scores["rm"] == pytest.approx([0.3, 0.5]) and res.source_scores["half"] == [0.75, 0.75]
    assert res.stats["reward/mean"] == pytest.approx(0.7) and res.stats["reward/boxed/mean"] == 0.5
    assert res.stats["reward/correct/length"] == pytest.approx((2 + 9) / 2)
    assert seen == [[3, 5]] and not res.errors


def test_single_source_keys_still_work_and_pass_extra():
    cfg = RewardConfig(function=f"{FUNCS}:sees_extra", workers=1)
    (src,) = reward_sources(cfg)
    assert (src.name, src.kind, src.weight) == ("sees_extra", "function", 1.0)
    assert reward_sources(RewardConfig(builtin="gsm8k"))[0].ref == "mrl.reward.builtins:gsm8k"
    with Rewarder.from_config(cfg) as r:
        res = r.score([RewardSample(0, "q", "r", "g", data_source="src", extra={"level": 3}),
                       RewardSample(1, "q", "r", "g", data_source="other", extra={"level": 3})])
    assert res.scores == [1.0, 0.0]


@pytest.mark.parametrize("cfg,key,message", [
    (RewardConfig(), "reward", "set exactly one of reward.function, reward.builtin, reward.model_path (got none)"),
    (RewardConfig(builtin="math", sources=({"name": "a", "builtin": "math"},)), "reward.sources", "not both"),
    (RewardConfig(sources=({"builtin": "math"},)), "reward.sources[0].name", "missing"),
    (RewardConfig(sources=({"name": "a", "builtin": "math"}, {"name": "a", "builtin": "gsm8k"})), "reward.sources[1].name", "used by another"),
    (RewardConfig(sources=({"name": "a", "builtin": "maths"},)), "reward.sources[0].builtin", "did you mean 'math'?"),
    (RewardConfig(sources=({"name": "a", "builtin": "math", "wieght": 2},)), "reward.sources[0].wieght", "did you mean `weight`?"),
    (RewardConfig(sources=({"name": "a", "builtin": "math", "function": f"{FUNCS}:half"},)), "reward.sources[0]", "got function, builtin"),
    (RewardConfig(sources=({"name": "a", "builtin": "math", "weight": "high"},)), "reward.sources[0].weight", "must be a number"),
    (RewardConfig(sources=({"name": "a", "function": f"{FUNCS}:hang"},)), "reward.sources[0].function", "did you mean 'hangs'?"),
    (RewardConfig(sources=({"name": "a", "model_path": "x"}, {"name": "b", "model_path": "y"})), "reward.sources", "one reward model"),
])
def test_source_problems_name_the_key(cfg, key, message):
    problems = reward_problems(cfg)
    assert any(k == key and message in m for k, m in problems), problems
    with pytest.raises(UserError):
        reward_sources(cfg)


def test_reward_model_micro_batches_and_nan():
    assert micro_batches([3, 3, 3, 10, 2], 8) == [[0, 1], [2], [3], [4]]
    assert micro_batches([3, 3], None) == [[0, 1]]
    calls = []

    def forward(batch):
        calls.append(len(batch))
        return [float("nan") if len(s) == 1 else float(sum(s)) for s in batch]

    scorer = RewardModelScorer(forward, micro_batch_tokens=6)
    out = scorer([[1, 2], [3, 4], [5], [6, 7, 8]])
    assert out[:2] == [3.0, 7.0] and math.isnan(out[2]) and out[3] == 21.0 and calls == [3, 1]
    with Rewarder([RewardSource("rm", "model", "x")], model_scorer=scorer) as r:
        res = r.score([RewardSample(i, "", "", "", token_ids=t) for i, t in enumerate([[1, 2], [5]])])
    assert res.scores == [3.0, 0.0] and [(e.sample_id, e.kind) for e in res.errors] == [(1, "non_finite")]
    with pytest.raises(RuntimeError, match="returned 1 scores for 2 sequences"):
        RewardModelScorer(lambda b: [0.0])([[1], [2]])
