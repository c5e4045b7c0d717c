"""A local judge on mrl's rollout engines (`reward.judge.engine`): scoring through the engine
factory, batching, sleep between calls, too-long prompts and parse failures counted, and the
rules `mrl validate` applies to the judge's engine keys and its placement."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from mrl.reward.compose import Rewarder, RewardSample
from mrl.reward.config import JudgeConfig, RewardConfig
from mrl.reward.judge import EngineJudge, judge_engine_problems, judge_placement_problems, judge_messages
from mrl.rollout.config import RolloutConfig
from mrl.rollout.hf import HFEngine
from mrl.rollout.types import Response
from mrl.rollout.vllm_engine import vllm_available

TINY = "builtin:tiny-qwen2"


def _samples(n: int) -> list[RewardSample]:
    return [RewardSample(i, f"What is {i} + 1?", f"It is {i + 1}.", str(i + 1)) for i in range(n)]


def _conversations(cfg: JudgeConfig, n: int) -> list[list[dict]]:
    return [judge_messages(cfg.template, cfg.system, s.prompt, s.response, s.ground_truth) for s in _samples(n)]


@pytest.fixture(scope="module")
def judge():
    j = EngineJudge(JudgeConfig(model=TINY, max_tokens=4, max_num_seqs=3))
    yield j
    j.close()


def test_hf_judge_is_the_factory_engine_asleep_between_calls_and_batch_invariant(judge):
    assert isinstance(judge.engine, HFEngine) and judge.engine._asleep   # built by the factory, asleep until asked
    assert judge.max_model_len == 1024 and judge.engine.max_num_seqs == 3   # the preset's context; batches of 3
    conversations = _conversations(judge.cfg, 7)
    prompts = [judge._prompt_ids(c) for c in conversations]
    whole = judge.engine
    whole.wake()
    try:   # the same greedy answers decoded in one batch of 7
        whole.max_num_seqs = 7
        expected = [r.token_ids for r in whole.generate(prompts, judge.sampling)]
    finally:
        whole.max_num_seqs = 3
        whole.sleep()
    answers = [judge.tokenizer.decode(t, skip_special_tokens=True) for t in expected]
    outcomes = judge(conversations)
    assert judge.engine._asleep
    assert len(outcomes) == 7 and all((o.error is None) != (o.error == "parse") for o in outcomes)
    for o, a in zip(outcomes, answers):
        if o.error is None:
            assert o.value["rating"] == float(re.search(judge.cfg.pattern, a).group(1))
        else:
            assert repr(a[:120]) in o.message


def test_answers_are_parsed_and_failures_counted_through_the_rewarder(monkeypatch):
    cfg = RewardConfig(judge=JudgeConfig(model=TINY, max_tokens=4, max_model_len=200), workers=1)
    with Rewarder.from_config(cfg) as rewarder:
        [scorer] = rewarder.services.values()
        local = scorer.model
        texts = iter(["7", "no idea", "10"])

        def answer(prompts, sampling, prompt_seeds=None):   # the engine's answers, chosen by the test
            assert not local.engine._asleep and sampling.temperature == 0 and sampling.max_tokens == 4
            ids = [local.tokenizer(next(texts), add_special_tokens=False)["input_ids"] for _ in prompts]
            return [Response(prompt_index=i, token_ids=t, logprobs=[0.0] * len(t), finish_reason="stop")
                    for i, t in enumerate(ids)]

        monkeypatch.setattr(local.engine, "generate", answer)
        short = [RewardSample(i, "q", r, "a") for i, r in enumerate(("x", "y", "z"))]
        long = RewardSample(3, "q" * 80, "w", "a")   # its judge prompt is over 200 byte tokens (the others ~125)
        res = rewarder.score(short[:2] + [long] + short[2:])
    scores = res.source_scores["judge"]
    assert scores[0] == pytest.approx(0.7) and math.isnan(scores[1]) and math.isnan(scores[2])
    assert scores[3] == pytest.approx(1.0)
    assert res.stats["reward/judge/errors/parse"] == 1.0 and res.stats["reward/judge/errors/too_long"] == 1.0
    assert local.engine.model is None and not Path(local._scratch).exists()   # closed with the rewarder


def test_engine_keys_are_refused_where_nothing_reads_them():
    assert judge_engine_problems(JudgeConfig(model=TINY)) == []
    assert judge_engine_problems(JudgeConfig(model=TINY, engine="vllm", tensor_parallel=2,
                                             engine_kwargs={"enforce_eager": True})) == []
    http = judge_engine_problems(JudgeConfig(url="http://x/v1", max_num_seqs=8, sleep=False))
    assert [k for k, _ in http] == ["reward.judge.max_num_seqs", "reward.judge.sleep"]
    hf = judge_engine_problems(JudgeConfig(model=TINY, gpu_memory_utilization=0.5, dtype="bfloat16"))
    assert hf == [("reward.judge.gpu_memory_utilization", "applies to reward.judge.engine = 'vllm' only")]
    [(key, message)] = judge_engine_problems(JudgeConfig(model=TINY, max_model_len=16))
    assert key == "reward.judge.max_model_len" and "no room" in message


def test_vllm_judge_placement_rules():
    vllm_judge = JudgeConfig(model=TINY, engine="vllm", gpu_memory_utilization=0.6)
    errors, _ = judge_placement_problems(vllm_judge, RolloutConfig(engine="vllm", gpu_memory_utilization=0.5), "cuda")
    assert ("reward.judge.gpu_memory_utilization", "0.6 + rollout.gpu_memory_utilization 0.5 = 1.1 > 1: the judge "
            "and the rollout engine share the scoring rank's GPU") in errors
    errors, _ = judge_placement_problems(vllm_judge, RolloutConfig(engine="hf"), "cuda")
    assert not [e for e in errors if e[0] == "reward.judge.gpu_memory_utilization"]
    assert judge_placement_problems(JudgeConfig(model=TINY), RolloutConfig(engine="vllm"), "cuda") == ([], [])
    if not vllm_available():   # refused on the cpu platform (this environment runs it), a warning on cuda
        errors, warnings = judge_placement_problems(vllm_judge, RolloutConfig(engine="hf"), "cpu")
        assert [k for k, _ in errors] == ["reward.judge.engine"] and "not importable" in errors[0][1]
        errors, warnings = judge_placement_problems(vllm_judge, RolloutConfig(engine="hf"), "cuda")
        assert errors == [] and [k for k, _ in warnings] == ["reward.judge.engine"]


def test_a_vllm_judge_takes_its_ranks_gpu_and_the_next_ones(monkeypatch):
    from mrl.errors import UserError
    from mrl.rollout.factory import engine_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    assert engine_gpus("cuda:1", 2, "reward.judge") == ["5", "6"]
    assert engine_gpus("cuda:0", 1, "reward.judge") == ["3"]
    assert engine_gpus("cpu", 2, "reward.judge") is None
    with pytest.raises(UserError, match=r"reward.judge.tensor_parallel = 2: 2 GPUs from this rank's GPU 3 on, "
                                        r"but this node shows 4"):
        engine_gpus("cuda:3", 2, "reward.judge")
