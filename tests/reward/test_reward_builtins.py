"""Every builtin reward on hand-checkable cases."""
import pytest

from mrl.data.gym import gym_records
from mrl.reward import builtins as b


@pytest.mark.parametrize("response,truth,want", [
    ("<answer>42</answer>", "42", 1.0),
    ("so \\boxed{42}", "42", 1.0),
    ("  42\n", "42", 1.0),
    ("The answer is 42", "42", 0.0),
    ("<answer>41</answer> \\boxed{42}", "42", 0.0),  # the tag wins over the box
])
def test_exact_match(response, truth, want):
    assert b.exact_match("", response, truth, {}) == want


@pytest.mark.parametrize("response,truth,want", [
    ("3 + 4 = 7\n#### 7", "7", 1.0),
    ("#### 1,234", "He paid 1234.\n#### 1234", 1.0),  # GSM8K solution as ground truth; commas dropped
    ("#### 7.0", "7", 1.0),
    ("#### -3", "-3", 1.0),
    ("#### 5 ... wait #### 8", "8", 1.0),  # the last one counts
    ("the answer is 7", "7", 0.0),  # strict format: no ####
    ("#### 8", "7", 0.0),
])
def test_gsm8k(response, truth, want):
    out = b.gsm8k("", response, truth, {})
    assert out["score"] == want and out["formatted"] == float("####" in response)


@pytest.mark.parametrize("response,truth,want", [
    ("so x = \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("The roots give \\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("first 3, finally \\boxed{4}", "3", 0.0),  # the boxed answer wins
    ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
    ("no answer here", "7", 0.0),
])
def test_math_verify(response, truth, want):
    assert b.math("", response, truth, {})["score"] == want


def test_reasoning_gym_scorer_on_generated_and_file_rows():
    rec = gym_records("chain_sum", 1, seed=4)[0]
    extra = {"reasoning_gym": rec["reasoning_gym"]}
    right, wrong = rec["answer"], str(int(rec["answer"]) + 1)
    assert b.reasoning_gym(rec["prompt"], f"<answer>{right}</answer>", right, extra) == {"score": 1.0, "acc": 1.0, "tagged": 1.0}
    assert b.reasoning_gym(rec["prompt"], f"<answer>{wrong}</answer>", right, extra)["score"] == 0.0
    assert b.reasoning_gym(rec["prompt"], right, right, extra) == {"score": 0.0, "acc": 0.0, "tagged": 0.0}  # needs the tags
    # a parquet row names its task through the data source
    assert b.reasoning_gym("1 + 2 =", "<answer>3</answer>", "3", {"data_source": "reasoning_gym/chain_sum"})["score"] == 1.0
    with pytest.raises(ValueError, match="no reasoning-gym task"):
        b.reasoning_gym("q", "<answer>3</answer>", "3", {"data_source": "gsm8k"})


@pytest.mark.parametrize("fn,response,want", [
    (b.format_boxed, "x \\boxed{3}", 1.0),
    (b.format_boxed, "x \\boxed{ }", 0.0),
    (b.format_boxed, "x = 3", 0.0),
    (b.format_boxed, "\\boxed{\\frac{1}{2}", 0.0),  # unbalanced
    (b.format_answer_tags, "think... <answer>3</answer>", 1.0),
    (b.format_answer_tags, "<answer>3</answer><answer>4</answer>", 0.0),
    (b.format_answer_tags, "<answer></answer>", 0.0),
    (b.format_think_answer, "<think>1+2</think>\n<answer>3</answer>", 1.0),
    (b.format_think_answer, "<think>1+2</think> then <answer>3</answer>", 0.0),
    (b.format_think_answer, "<answer>3</answer>", 0.0),
])
def test_format_rewards(fn, response, want):
    assert fn("", response, "3", {}) == want


def test_last_boxed_balances_braces():
    assert b.last_boxed("\\boxed{1} and \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
