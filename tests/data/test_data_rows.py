"""Parquet prompt files: custom column names, chat-message cells, bad rows counted or refused."""
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mrl.data.parquet import read_parquet_rows
from mrl.data.rows import Columns
from mrl.errors import UserError

COLS = Columns(prompt="question", answer="solution", source="origin")


def write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_custom_columns_and_chat_cells(tmp_path):
    text = write(tmp_path / "math.parquet", [{"question": "1+1?", "solution": "2", "origin": "arith", "level": 1}])
    chat = write(tmp_path / "chat.parquet", [
        {"question": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
         "solution": "4", "origin": None, "level": 2},
        {"question": [], "solution": "4", "origin": None, "level": 3},  # empty message list: dropped
    ])
    stats = Counter()
    rows = read_parquet_rows([text, chat], columns=COLS, stats=stats)
    assert [r.prompt for r in rows] == ["1+1?", [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]]
    assert [r.answer for r in rows] == ["2", "4"]
    assert [r.data_source for r in rows] == ["arith", "chat"]  # a null source falls back to the file stem
    assert rows[1].extra == {"level": 2} and rows[1].origin.endswith("chat.parquet row 0")
    assert stats == {"rows_read": 3, "rows_bad_prompt": 1}


BAD = [
    {"question": "ok?", "solution": "1"},
    {"question": "", "solution": "1"},  # empty prompt
    {"question": None, "solution": "1"},  # missing prompt
    {"question": "no answer", "solution": None},
    {"question": "blank answer", "solution": "  "},
    {"question": " \n", "solution": "1"},  # blank prompt
    {"question": "fine too", "solution": "0"},
]


def test_bad_rows_are_counted_and_dropped(tmp_path, caplog):
    f = write(tmp_path / "bad.parquet", BAD)
    stats = Counter()
    rows = read_parquet_rows([f], columns=COLS, bad_rows="warn", stats=stats)
    assert [r.prompt for r in rows] == ["ok?", "fine too"]
    assert stats == {"rows_read": 7, "rows_bad_prompt": 3, "rows_missing_answer": 2}
    assert "dropped 5 of 7 rows" in caplog.text


def test_bad_rows_error_names_the_row(tmp_path):
    f = write(tmp_path / "bad.parquet", BAD)
    with pytest.raises(UserError, match=r"bad.parquet row 1: prompt column 'question' \(data.prompt_key\) empty"):
        read_parquet_rows([f], columns=COLS, bad_rows="error")


def test_answer_optional_for_reward_models(tmp_path):
    f = write(tmp_path / "rm.parquet", [{"question": "hi"}])
    assert len(read_parquet_rows([f], columns=COLS, require_answer=False)) == 1


def test_missing_column_and_file(tmp_path):
    f = write(tmp_path / "x.parquet", [{"prompt": "a", "answer": "b"}])
    with pytest.raises(UserError, match=r"no column 'question' \(data.prompt_key\); columns: prompt, answer"):
        read_parquet_rows([f], columns=COLS)
    with pytest.raises(UserError, match="parquet file not found"):
        read_parquet_rows([str(tmp_path / "nope.parquet")], columns=COLS)
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(UserError, match="not a readable parquet file"):
        read_parquet_rows([str(tmp_path / "junk.parquet")], columns=COLS)
