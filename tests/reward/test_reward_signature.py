"""verl reward functions run as they are: the convention is read from parameter names (or stated
in reward.signature), verl's arguments are passed by name, and unbindable parameters are refused."""
from __future__ import annotations

from pathlib import Path

import pytest

from mrl.reward.compose import Rewarder, RewardSample
from mrl.reward.config import RewardConfig
from mrl.reward.function import reward_call
from mrl.reward.sources import reward_problems, reward_sources

VERL = str(Path(__file__).with_name("verl_rewards.py"))


def _ref(tmp_path, source: str) -> str:
    f = tmp_path / "rw.py"
    f.write_text(source)
    return f"{f}:f"


@pytest.mark.parametrize("source,declared,convention,passed", [
    ("def f(data_source, solution_str, ground_truth, extra_info=None, **kwargs): pass", "auto", "verl",
     ("data_source", "solution_str", "ground_truth", "extra_info")),
    ("def f(data_source, solution_str, ground_truth): pass", "auto", "verl", ("data_source", "solution_str", "ground_truth")),
    ("def f(solution_str, ground_truth, extra_info): pass", "auto", "verl", ("solution_str", "ground_truth", "extra_info")),
    ("def f(prompt, response, ground_truth, extra): pass", "auto", "mrl", None),
    ("def f(a, b, c, d): pass", "auto", "mrl", None),
    ("def f(*, solution_str, ground_truth): pass", "verl", "verl", ("solution_str", "ground_truth")),
    ("def f(**kw): pass", "verl", "verl", ("data_source", "solution_str", "ground_truth", "extra_info")),
])
def test_the_convention_is_read_from_parameter_names(tmp_path, source, declared, convention, passed):
    problem, conv, names = reward_call(_ref(tmp_path, source), declared)
    assert problem is None and conv == convention
    if passed is not None:
        assert names == passed


@pytest.mark.parametrize("source,declared,fragment", [
    ("def f(data_source, solution_str, ground_truth, tokenizer): pass", "auto", "parameter tokenizer cannot be bound"),
    ("def f(prompt, response, ground_truth, extra): pass", "verl", "parameters prompt, response, extra cannot be bound"),
    ("def f(data_source, solution_str, /, ground_truth): pass", "auto", "parameters data_source, solution_str cannot be bound"),
    ("def f(data_source, ground_truth, extra_info): pass", "auto", "takes no `solution_str`"),
    ("def f(data_source, solution_str, ground_truth, extra_info): pass", "mrl", None),
    ("def f(data_source, solution_str): pass", "mrl", "must accept 4 positional arguments"),
])
def test_parameters_the_convention_cannot_bind_are_refused(tmp_path, source, declared, fragment):
    problem = reward_call(_ref(tmp_path, source), declared)[0]
    if fragment is None:
        assert problem is None
    else:
        assert problem is not None and fragment in problem and "\n" not in problem


def test_validate_names_the_key_in_one_line(tmp_path):
    ref = _ref(tmp_path, "def f(data_source, solution_str, ground_truth, tokenizer):\n    return 0\n")
    (key, message), = reward_problems(RewardConfig(function=ref))
    assert key == "reward.function" and "rw.py:1: f parameter tokenizer cannot be bound" in message
    ref = _ref(tmp_path, "def f(solution_str, ground_truth):\n    return 0\n")
    (key, message), = reward_problems(RewardConfig(function=ref, kwargs={"scale": 2}))
    assert "reward.kwargs scale match no parameter" in message
    assert reward_problems(RewardConfig(builtin="gsm8k", signature="verl")) == [
        ("reward.signature", "applies to reward.function only")]
    (key, message), = reward_problems(RewardConfig(sources=({"name": "a", "function": ref, "signature": "verI"},)))
    assert key == "reward.sources[0].signature" and "is not one of 'auto', 'mrl', 'verl'" in message


def _samples():
    rows = [("chain_sum", "so 1+2 = 3", "3", 0), ("chain_sum", "so 1+2 = 4", "3", 1), ("quickstart", "x 7", "7", 2)]
    return [RewardSample(f"s{i}", [{"role": "user", "content": "prompt text"}], resp, truth, data_source=src,
                         extra={"extra_info": {"index": idx, "split": "train"}, "ability": "math"})
            for i, (src, resp, truth, idx) in enumerate(rows)]


def test_a_verl_function_scores_like_its_mrl_twin_with_dict_extras_as_metrics():
    samples = _samples()
    with Rewarder.from_config(RewardConfig(function=f"{VERL}:compute_score", workers=1, on_error="fail")) as r:
        verl = r.score(samples)
    with Rewarder.from_config(RewardConfig(function=f"{VERL}:score", workers=1, on_error="fail")) as r:
        mrl = r.score(samples)
    assert verl.scores == mrl.scores == [1.0, 0.0, 1.0]
    assert verl.metrics == {"compute_score/acc": [1.0, 0.0, 1.0], "compute_score/index": [0.0, 1.0, 2.0]}
    assert mrl.metrics == {"score/acc": [1.0, 0.0, 1.0], "score/index": [0.0, 1.0, 2.0]}


def test_verl_arguments_are_passed_by_name_only_where_the_function_takes_them():
    cfg = RewardConfig(sources=({"name": "three", "function": f"{VERL}:no_extra_info"},
                                {"name": "kw", "function": f"{VERL}:keyword_only", "signature": "verl",
                                 "kwargs": {"scale": 2.0}}), workers=1, on_error="fail")
    assert [s.convention for s in reward_sources(cfg)] == ["verl", "verl"]
    with Rewarder.from_config(cfg) as r:
        res = r.score([RewardSample("a", "p", "7", "7", data_source="d"), RewardSample("b", "p", "8", "7")])
    assert res.source_scores == {"three": [1.0, 0.0], "kw": [2.0, 0.0]}
