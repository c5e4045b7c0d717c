"""verl's parquet layout as is: answers at reward_model.ground_truth, rewards chosen by data_source,
and a ground truth a builtin cannot read is an error, never a silent 0."""
from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mrl.data.config import DataConfig
from mrl.data.rows import Columns, rows_from_records
from mrl.data.source import load_rows
from mrl.errors import UserError
from mrl.reward import builtins as b


def _verl_parquet(path, answers=("72", "3")):
    pq.write_table(pa.table({
        "data_source": ["openai/gsm8k", "lighteval/MATH"],
        "prompt": [[{"role": "user", "content": "Natalia sold clips..."}], [{"role": "user", "content": "1+2?"}]],
        "ability": ["math", "math"],
        "reward_model": [{"style": "rule", "ground_truth": a} for a in answers],
        "extra_info": [{"split": "train", "index": 0}, {"split": "train", "index": 1}],
    }), path)
    return path


def test_verl_layout_is_read_with_the_default_answer_key(tmp_path):
    cfg = DataConfig(train_files=(str(_verl_parquet(tmp_path / "gsm8k.parquet")),))
    rows = load_rows(cfg, "train")
    assert [r.answer for r in rows] == ["72", "3"]
    assert [r.data_source for r in rows] == ["openai/gsm8k", "lighteval/MATH"]
    assert rows[0].prompt == [{"role": "user", "content": "Natalia sold clips..."}]
    assert rows[0].extra["reward_model"]["style"] == "rule" and rows[0].extra["extra_info"]["index"] == 0


def test_a_dotted_answer_key_reaches_into_table_columns():
    records = [{"prompt": "p", "meta": {"gold": {"value": 5}}}, {"prompt": "q", "meta": {"gold": {}}}]
    stats = Counter()
    rows = rows_from_records(records, columns=Columns(answer="meta.gold.value"), default_source="s", where="gen",
                             stats=stats)
    assert [r.answer for r in rows] == [5] and stats["rows_missing_answer"] == 1


def test_a_missing_dotted_column_names_the_key(tmp_path):
    cfg = DataConfig(train_files=(str(_verl_parquet(tmp_path / "d.parquet")),), answer_key="solution.text")
    with pytest.raises(UserError, match=r"no column 'solution.text' \(data.answer_key\)"):
        load_rows(cfg, "train")


def test_nan_answers_are_bad_rows():
    records = [{"prompt": "a", "answer": float("nan")}, {"prompt": "b", "answer": 1.5}]
    stats = Counter()
    rows = rows_from_records(records, columns=Columns(), default_source="s", where="f.parquet", stats=stats)
    assert [r.prompt for r in rows] == ["b"] and stats["rows_missing_answer"] == 1
    with pytest.raises(UserError, match=r"f.parquet row 0: NaN 'answer' \(data.answer_key\)"):
        rows_from_records(records, columns=Columns(), default_source="s", where="f.parquet", bad_rows="error")


@pytest.mark.parametrize("source,builtin", [
    ("openai/gsm8k", "gsm8k"), ("gsm8k", "gsm8k"), ("lighteval/MATH", "math"), ("HuggingFaceH4/MATH-500", "math"),
    ("math_dapo", "math"), ("aime2024", "math"), ("reasoning_gym/chain_sum", "reasoning_gym"), ("my_task", None),
])
def test_auto_picks_the_builtin_by_data_source(source, builtin):
    assert b.builtin_for_source(source) == builtin


def test_auto_scores_with_the_sources_builtin_and_refuses_unknown_sources():
    assert b.auto("", "so #### 72", "72", {"data_source": "openai/gsm8k"})["score"] == 1.0
    assert b.auto("", "so #### 71", "72", {"data_source": "openai/gsm8k"})["score"] == 0.0
    assert b.auto("", "\\boxed{\\frac{1}{2}}", "0.5", {"data_source": "lighteval/MATH"})["score"] == 1.0
    with pytest.raises(ValueError, match="auto: no builtin reward for data source 'my_task'"):
        b.auto("", "x", "1", {"data_source": "my_task"})


@pytest.mark.parametrize("name", ["exact_match", "gsm8k", "math"])
def test_a_ground_truth_a_builtin_cannot_read_is_an_error(name):
    fn = getattr(b, name)
    with pytest.raises(ValueError, match=rf"{name}: cannot read a ground truth of type dict; set data.answer_key .*"
                                         r"reward_model.ground_truth"):
        fn("", "#### 72", {"ground_truth": "72", "style": "rule"}, {})
    if name == "gsm8k":
        with pytest.raises(ValueError, match="gsm8k: no number in the ground truth 'seventy-two'"):
            fn("", "#### 72", "seventy-two", {})


def test_an_unreadable_ground_truth_is_a_counted_reward_error_not_a_zero():
    from mrl.reward.compose import Rewarder, RewardSample
    from mrl.reward.config import RewardConfig

    with Rewarder.from_config(RewardConfig(builtin="auto", workers=1)) as r:
        res = r.score([RewardSample("a", "q", "#### 72", {"ground_truth": "72"}, data_source="openai/gsm8k"),
                       RewardSample("b", "q", "#### 72", "72", data_source="openai/gsm8k")])
    assert res.stats["reward/errors"] == 1.0 and res.scores[1] == 1.0
    assert "cannot read a ground truth of type dict" in res.errors[0].message
