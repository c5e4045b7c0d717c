"""`reward.builtin = "auto"` scores as verl 0.9.1's default_compute_score, on hand-made answers per
data source; mrl's forgiving scorers keep their own names."""
from __future__ import annotations

import pytest

from mrl.reward import builtins as b
from mrl.reward import verl_scores as v


def _auto(source, response, truth):
    return b.auto("prompt", response, truth, {"data_source": source})["score"]


@pytest.mark.parametrize("response,score", [
    ("so the answer is\n#### 42", 1.0), ("#### 42.0", 0.0), ("####42", 0.0), ("#### 007", 0.0), ("#### 1,042", 0.0),
    ("#### 4,2", 1.0), ("#### 41 then #### 42", 1.0), ("#### 42 then #### 41", 0.0), ("the answer is 42", 0.0),
    ("#### 42" + " pad" * 80, 0.0), ("x" * 400 + "#### 42", 1.0),
])
def test_gsm8k_is_strict_like_verl(response, score):
    assert _auto("openai/gsm8k", response, "42") == score
    assert b.verl_gsm8k("", response, "42", {}) == score


def test_mrl_gsm8k_stays_forgiving():
    for response, truth in (("#### 42.0", "42"), ("####42", "42"), ("#### 007", "7")):
        assert _auto("openai/gsm8k", response, truth) == 0.0
        assert b.gsm8k("", response, truth, {})["score"] == 1.0
        assert b.auto_mrl("", response, truth, {"data_source": "openai/gsm8k"})["score"] == 1.0


@pytest.mark.parametrize("source", ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"])
@pytest.mark.parametrize("response,truth,score", [
    ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0), ("\\boxed{\\dfrac12}", "\\frac{1}{2}", 1.0), ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
    ("\\boxed{3} wait, \\boxed{4}", "4", 1.0), ("\\boxed{4} wait, \\boxed{3}", "4", 0.0), ("\\boxed 7$", "7", 1.0),
    ("\\boxed{x = 5}", "5", 1.0), ("\\boxed{10\\%}", "10", 1.0), ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{2 \\text{ cm}}", "2", 1.0), ("\\fbox{4}", "4", 0.0), ("no box: 4", "4", 0.0), ("\\boxed{\\sqrt2}", "\\sqrt{2}", 1.0),
    ("\\boxed{0.50}", "\\frac{1}{2}", 0.0),
])
def test_math_uses_the_last_box_and_hendrycks_normalisation(source, response, truth, score):
    assert _auto(source, response, truth) == score


@pytest.mark.parametrize("source", ["math_dapo", "math", "math_dapo_reasoning", "aime2024", "aime25"])
@pytest.mark.parametrize("response,truth,score", [
    ("reasoning...\nAnswer: 42", "42", 1.0), ("Answer: 41", "42", -1.0),
    ("answer : $42$", "42", 1.0), ("Answer: 1,000 dollars", "1000", 1.0), ("Answer: x = \\frac12", "\\frac{1}{2}", 1.0),
    ("Answer: 3\nAnswer: 42", "42", 1.0), ("Answer: 42\nno, Answer: 3", "42", -1.0), ("Answer: 42" + "." * 300, "42", -1.0),
    ("Answer: \\boxed{42}", "42", 1.0), ("", "42", -1.0),
])
def test_math_dapo_reads_the_answer_line_and_gives_minus_one(source, response, truth, score):
    out = b.auto("", response, truth, {"data_source": source})
    assert out["score"] == score and out["acc"] == (score == 1.0)


# verl 0.9.1's math_dapo.verify: without an "Answer:" line in the last 300 characters, the last
# \boxed{} of the last 100 characters (math_dapo.is_correct_strict_box), its content compared with the
# ground truth as text, not normalised. (Checked against verl 0.9.1's compute_score on 20,000
# generated responses: no difference.)
@pytest.mark.parametrize("response,truth,score,pred", [
    ("\\boxed{42}", "42", 1.0, "42"), ("so \\boxed{41} no, \\boxed{42}", "42", 1.0, "42"),
    ("\\boxed{42}" + "x" * 90, "42", 1.0, "42"),                # the box starts 100 characters from the end
    ("\\boxed{42}" + "x" * 91, "42", -1.0, "[INVALID]"),        # 101: outside the window
    ("Answer: 41\n\\boxed{42}", "42", -1.0, "41"),             # an Answer line wins
    ("\\boxed{\\frac12}", "\\frac{1}{2}", -1.0, "\\frac12"),  # text, not Minerva-normalised
    ("\\boxed{ 42}", "42", -1.0, " 42"), ("\\boxed{{42}}", "42", -1.0, "{42}"),
    ("\\fbox{42}", "42", -1.0, "[INVALID]"), ("\\boxed{42", "42", -1.0, "[INVALID]"),
])
def test_math_dapo_falls_back_to_the_last_box(response, truth, score, pred):
    assert v.math_dapo(response, truth) == {"score": score, "acc": score == 1.0, "pred": pred}
    assert b.auto("", response, truth, {"data_source": "aime2024"})["score"] == score


def test_math_dapo_reports_what_it_compared():
    assert v.math_dapo("Answer: $\\text{42 units}$", "42") == {"score": 1.0, "acc": True, "pred": "42"}
    assert v.minerva_normalize("\\$1,000") == "1000" and v.minerva_normalize("\\sqrt3") == "\\sqrt{3}"


@pytest.mark.parametrize("source", ["searchR1_nq", "searchR1_hotpotqa", "searchR1_bamboogle"])
@pytest.mark.parametrize("response,score", [
    ("<answer>Paris</answer>", 1.0), ("<answer> the PARIS. </answer>", 1.0), ("<answer>Lyon</answer><answer>paris</answer>", 1.0),
    ("<answer>Paris, France</answer>", 0.0), ("Paris", 0.0), ("<answer>Paris</answer>" * 11, 0.25),
    ("<answer>City of Light</answer>", 1.0),
])
def test_search_r1_exact_match(source, response, score):
    assert _auto(source, response, {"target": ["Paris", "city of light"]}) == score


@pytest.mark.parametrize("source,fragment", [
    # code contests go to the code reward, which names a ground truth that holds no tests
    ("codecontests", "code: cannot read test cases"), ("apps", "code: cannot read test cases"),
    ("codeforces", "code: cannot read test cases"), ("taco", "code: cannot read test cases"),
    ("livecodebench/v5", "code: cannot read test cases"), ("my_task", "no builtin reward for data source 'my_task'"),
    ("gsm8k", "no builtin reward for data source 'gsm8k'"), ("openai/GSM8K", "no builtin reward"),
])
def test_sources_verl_scores_elsewhere_are_errors_that_say_so(source, fragment):
    with pytest.raises(ValueError, match=fragment):
        _auto(source, "\\boxed{1}", "1")


def test_reasoning_gym_rows_keep_the_tasks_scorer():
    out = b.auto("", "<answer>7</answer>", "7", {"data_source": "reasoning_gym/chain_sum"})
    assert out["score"] == 1.0 and out["tagged"] == 1.0


def test_numbers_are_reported_as_acc_like_verls_reward_loop():
    assert b.auto("", "#### 42", "42", {"data_source": "openai/gsm8k"}) == {"score": 1.0, "acc": 1.0}


def test_a_table_ground_truth_is_an_error_not_a_zero():
    with pytest.raises(ValueError, match="gsm8k: cannot read a ground truth of type dict"):
        _auto("openai/gsm8k", "#### 42", {"ground_truth": "42"})
    with pytest.raises(ValueError, match="search_r1_qa: the ground truth must be a table with 'target'"):
        _auto("searchR1_nq", "<answer>x</answer>", "x")


def test_mrl_math_takes_the_last_boxed_answer_of_a_self_correction():
    assert b.math("", "First \\boxed{3}. Wait, that is wrong: \\boxed{4}", "4", {})["score"] == 1.0
    assert b.math("", "First \\boxed{4}. Wait: \\boxed{3}", "4", {})["score"] == 0.0
    assert b.math("", "\\boxed{\\frac{1}{2}}", "0.5", {})["score"] == 1.0


def test_a_code_source_in_a_batch_goes_to_the_code_reward():
    from mrl.reward.compose import Rewarder, RewardSample
    from mrl.reward.config import RewardConfig

    tests = '{"inputs": ["2\\n"], "outputs": ["4\\n"]}'
    with Rewarder.from_config(RewardConfig(builtin="auto", workers=1)) as r:
        res = r.score([RewardSample("a", "q", "print(1)", "tests", data_source="apps"),   # unreadable tests: an error
                       RewardSample("b", "q", "Answer: 4", "5", data_source="math_dapo"),
                       RewardSample("c", "q", "```python\nprint(int(input()) * 2)\n```", tests, data_source="apps")])
    assert res.scores == [0.0, -1.0, 1.0] and res.stats["reward/errors"] == 1.0
    assert "code: the ground truth is text but not JSON test cases" in res.errors[0].message


def test_validate_accepts_auto_on_code_contest_data(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mrl.reward.config import RewardConfig
    from mrl.reward.sources import auto_source_problems

    f = tmp_path / "code.parquet"
    pq.write_table(pa.table({"data_source": ["apps", "openai/gsm8k", "livecodebench_v5"], "prompt": ["a", "b", "c"]}), f)
    assert auto_source_problems(RewardConfig(builtin="auto"), (str(f),), "data_source") == []   # the code builtin scores them
    assert b.builtin_for_source("apps") == "code"


@pytest.mark.parametrize("response,truth,score", [
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0), ("so the answer is 0.5", "\\frac{1}{2}", 1.0),
    ("The answer is 1,000.", "1000", 1.0), ("answer: 2\\pi", "6.28", 1.0), ("\\boxed{6.283}", "2\\pi", 1.0),
    ("\\boxed{(1, 2)}", "(1,2)", 1.0), ("\\boxed{(2, 1)}", "(1,2)", 0.0), ("\\boxed{Interval(0, 1)}", "[0,1]", 1.0),
    ("\\boxed{0.5}", "50", 1.0), ("\\boxed{101_2}", "101", 1.0), ("\\boxed{5 cm}", "5", 1.0),
    ("\\boxed{3 million}", "3000000", 0.0), ("\\boxed{x+1}", "1+x", 1.0), ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),
    ("\\boxed{2^3}", "8", 0.0), ("\\boxed{7 3/4}", "7\\frac{3}{4}", 1.0), ("\\boxed{0.333}", "\\frac{1}{3}", 0.0),
    ("\\boxed{A}", "\\text{(A)}", 1.0), ("\\boxed{4, 3}", "3,4", 0.0), ("42 is the answer", "42", 1.0),
    ("\\boxed{3.14}", "\\pi", 1.0), ("\\boxed{10^3}", "1000", 0.0), ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{}", "0", 0.0), ("\\boxed{[1,2]}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", 0.0),
])
def test_numina_sources_use_primes_grader(response, truth, score):
    """Scores as verl's prime_math gives them (each pair was run through verl's code too)."""
    assert _auto("numina_olympiads", response, truth) == score


def test_every_numina_source_routes_to_prime_math():
    for source in ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                   "numina_cn_k12", "numina_olympiads"):
        assert v.verl_route(source) == "prime_math" and _auto(source, "answer is 7", "7") == 1.0


def test_model_text_is_never_run_as_code():
    from mrl.reward import prime_math

    assert prime_math.arithmetic_eval("[1, 2*3.5, -2**2]") == [1, 7.0, -4]
    for text in ("__import__('os').system('true')", "x + 1", "9**99999", "(lambda: 1)()"):
        with pytest.raises(ValueError):
            prime_math.arithmetic_eval(text)
    assert prime_math.compute_score("\\boxed{[__import__('os')]}", "\\begin{pmatrix} 1 \\end{pmatrix}") == 0.0


@pytest.mark.parametrize("response,truth,score", [
    ("<think>x</think> so \\boxed{30}", "30", 1.0), ("\\boxed{30}", "30", 0.9), ("<think>x</think>\\boxed{31}", "30", 0.1),
    ("<think>a</think> \\boxed{2\\sqrt{3}}", "2 \\sqrt{3}", 1.0), ("\\boxed{50%}", "50", 0.9), ("no box", "None", 0.9),
    ("\\boxed{5 liter}", "5", 0.0), ("\\boxed{4\\sqrt{3}}", "\\sqrt{48}", 0.9), ("<think>\\boxed{1}</think>", "1", 0.9),
    ("\\boxed{ {3} }", "3", 0.9),
])
def test_geometry3k_uses_mathrulers_grader_and_a_format_bonus(response, truth, score):
    """Scores as verl's geo3k with mathruler 0.1.0 gives them (each pair was run through that code too)."""
    assert _auto("hiyouga/geometry3k", response, truth) == score
