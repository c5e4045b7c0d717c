"""`mrl data`: verl-format parquet from local GSM8K-/MATH-shaped datasets (each layout Hugging Face
writes) and from reasoning-gym tasks, read back by mrl's own loader and scored by `auto`."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mrl.cli import main
from mrl.data import prepare
from mrl.data.config import DataConfig
from mrl.data.source import load_rows
from mrl.errors import UserError
from mrl.reward import builtins as b

GSM8K = [{"question": "Natalia sold 48 clips and then half as many. How many?", "answer": "48/2 = 24\n48+24 = 72\n#### 72"},
         {"question": "A shop sells 1,000 pens twice.", "answer": "1,000*2 = 2,000\n#### 2,000"}]
MATH = [{"problem": "What is $1/2 + 1/4$?", "solution": "It is $\\boxed{\\frac{3}{4}}$.", "level": "Level 1", "type": "Algebra"},
        {"problem": "Solve $x+1=3$.", "solution": "First \\boxed{3}, no: $x=\\boxed{2}$", "level": "Level 2", "type": "Algebra"}]


def _jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _arrow_stream(path, records):   # datasets' save_to_disk format
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(records)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def _layouts(tmp_path, records):
    hub = tmp_path / "hub"
    for config in ("main", "socratic"):
        (hub / config).mkdir(parents=True)
        for split, recs in (("train", records), ("test", records[:1])):
            rows = recs if config == "main" else [{**r, "answer": "#### 0"} for r in recs]
            pq.write_table(pa.Table.from_pylist(rows), hub / config / f"{split}-00000-of-00001.parquet")
    saved = tmp_path / "saved"
    (saved / "dataset_dict.json").parent.mkdir(parents=True)
    (saved / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    _arrow_stream(saved / "train" / "data-00000-of-00001.arrow", records)
    _arrow_stream(saved / "test" / "data-00000-of-00001.arrow", records[:1])
    (saved / "train" / "state.json").write_text("{}")
    jsonl = tmp_path / "jsonl"
    _jsonl(jsonl / "train.jsonl", records)
    _jsonl(jsonl / "test.jsonl", records[:1])
    return {"hub": hub, "saved": saved, "jsonl": jsonl}


@pytest.mark.parametrize("layout", ["hub", "saved", "jsonl"])
def test_gsm8k_from_each_layout_is_verls_format_and_reads_back(tmp_path, layout, capsys):
    src = _layouts(tmp_path, GSM8K)[layout]
    assert main(["data", "gsm8k", str(src), str(tmp_path / "out")]) == 0
    assert "train.parquet: 2 rows" in capsys.readouterr().out
    table = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert table[0]["data_source"] == "openai/gsm8k" and table[0]["ability"] == "math"
    assert table[0]["prompt"] == [{"role": "user", "content": GSM8K[0]["question"] + " " + prepare.GSM8K_INSTRUCTION}]
    assert [r["reward_model"] for r in table] == [{"style": "rule", "ground_truth": "72"},
                                                  {"style": "rule", "ground_truth": "2000"}]
    assert table[1]["extra_info"] == {"split": "train", "index": 1, "answer": GSM8K[1]["answer"],
                                      "question": GSM8K[1]["question"]}
    rows = load_rows(DataConfig(train_files=(str(tmp_path / "out" / "train.parquet"),)), "train")
    assert [r.answer for r in rows] == ["72", "2000"] and rows[0].data_source == "openai/gsm8k"
    assert b.auto("", "... #### 2000", rows[1].answer, {"data_source": rows[1].data_source})["score"] == 1.0
    assert len(pq.read_table(tmp_path / "out" / "test.parquet")) == 1


def test_math_takes_the_last_boxed_answer_and_keeps_other_columns(tmp_path):
    _jsonl(tmp_path / "math.jsonl", MATH)
    (path,) = prepare.prepare_shaped("math", str(tmp_path / "math.jsonl"), str(tmp_path / "out"))
    assert path.name == "math.parquet"
    table = pq.read_table(path).to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in table] == ["\\frac{3}{4}", "2"]
    assert table[0]["data_source"] == "DigitalLearningGmbH/MATH-lighteval" and table[0]["level"] == "Level 1"
    assert table[0]["prompt"][0]["content"].endswith("output the final answer within \\boxed{}.")
    assert table[1]["extra_info"] == {"split": "math", "index": 1}
    rows = load_rows(DataConfig(train_files=(str(path),)), "train")
    assert b.auto("", "so \\boxed{\\dfrac34}", rows[0].answer, {"data_source": rows[0].data_source})["score"] == 1.0


def test_split_subset_and_data_source_options(tmp_path):
    src = _layouts(tmp_path, GSM8K)["hub"]
    out = prepare.prepare_shaped("gsm8k", str(src), str(tmp_path / "o"), subset="socratic", splits=("test",),
                                 data_source="gsm8k_socratic")
    table = pq.read_table(out[0]).to_pylist()
    assert [p.name for p in out] == ["test.parquet"] and table[0]["reward_model"]["ground_truth"] == "0"
    assert table[0]["data_source"] == "gsm8k_socratic"


@pytest.mark.parametrize("records,fragment", [
    ([{"question": "q", "answer": "no marker"}], "row 0: no answer in 'answer'"),
    ([{"prompt": "q", "answer": "#### 1"}], "row 0: no column 'question'; columns: prompt, answer"),
])
def test_bad_rows_are_named(tmp_path, records, fragment):
    _jsonl(tmp_path / "train.jsonl", records)
    with pytest.raises(UserError, match=fragment):
        prepare.prepare_shaped("gsm8k", str(tmp_path / "train.jsonl"), str(tmp_path / "o"))


def test_missing_split_subset_or_source_are_one_line_errors(tmp_path, capsys):
    src = _layouts(tmp_path, GSM8K)["jsonl"]
    with pytest.raises(UserError, match=r"no split 'validation' \(--split\); splits: test, train"):
        prepare.prepare_shaped("gsm8k", str(src), str(tmp_path / "o"), splits=("validation",))
    with pytest.raises(UserError, match="no data files under a directory named 'main'"):
        prepare.read_splits(_layouts(tmp_path / "b", GSM8K)["saved"], subset="main")
    assert main(["data", "math", str(tmp_path / "nowhere"), str(tmp_path / "o")]) != 0
    assert "no such file or directory" in capsys.readouterr().err


def test_a_reasoning_gym_task_writes_rows_its_scorer_reads(tmp_path):
    assert main(["data", "gym", "chain_sum", str(tmp_path / "gym"), "--train-size", "6", "--test-size", "2",
                 "--seed", "3", "--option", "min_terms=2", "--option", "max_terms=3"]) == 0
    train = pq.read_table(tmp_path / "gym" / "train.parquet").to_pylist()
    assert len(train) == 6 and len(pq.read_table(tmp_path / "gym" / "test.parquet")) == 2
    assert train[0]["data_source"] == "reasoning_gym/chain_sum" and train[0]["prompt"][0]["role"] == "system"
    assert "<answer>" in train[0]["prompt"][0]["content"]
    rows = load_rows(DataConfig(train_files=(str(tmp_path / "gym" / "train.parquet"),)), "train")
    for row in rows:
        extra = {**row.extra, "data_source": row.data_source}
        assert b.auto("", f"<answer>{row.answer}</answer>", row.answer, extra)["score"] == 1.0
        assert b.reasoning_gym("", "<answer>nonsense</answer>", row.answer, extra)["score"] == 0.0
    again = prepare.gym_rows("chain_sum", 6, 3, "train", {"min_terms": 2, "max_terms": 3})
    assert [r["reward_model"] for r in again] == [r["reward_model"] for r in train]
    with pytest.raises(UserError, match="reasoning-gym has no task 'chain_sun'; did you mean 'chain_sum'"):
        prepare.gym_rows("chain_sun", 2, 0, "train")


def _png(w, h, colour):
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buf, format="PNG")
    return buf.getvalue()


GEO3K = [{"problem": "<image>Find x.", "answer": "3", "images": [{"bytes": _png(56, 56, "white"), "path": "a.png"}]},
         {"problem": "<image>Find the area of the figure.", "answer": "12.5",
          "images": [{"bytes": _png(90, 50, "black"), "path": "b.png"}]}]


def test_geo3k_is_verls_multimodal_layout_and_trains_as_it_is(tmp_path, capsys):
    """geometry3k in the hub's layout (data/<split>-*.parquet, images as {bytes, path}) -> verl's
    geo3k rows: the problem with its <image> mark + verl's instruction, the images as they were;
    mrl's loader (the tiny Qwen2.5-VL's processor) expands each mark to its image's tokens, and
    `auto` routes the rows to verl's geo3k scorer. A row whose marks do not pair up is named."""
    from mrl.data.images import model_image_processor
    from mrl.models.config import ModelConfig
    from mrl.models.megatron import hf_config
    from mrl.models.tokenizer import load_tokenizer
    from mrl.data.source import load_prompts

    (tmp_path / "geo" / "data").mkdir(parents=True)
    for split, recs in (("train", GEO3K), ("test", GEO3K[:1])):
        pq.write_table(pa.Table.from_pylist(recs), tmp_path / "geo" / "data" / f"{split}-00000-of-00001.parquet")
    assert main(["data", "geo3k", str(tmp_path / "geo"), str(tmp_path / "out")]) == 0
    assert "train.parquet: 2 rows" in capsys.readouterr().out
    table = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert table[1]["prompt"] == [{"role": "user", "content": "<image>Find the area of the figure. " +
                                   prepare.GEO3K_INSTRUCTION}]
    assert table[1]["images"] == GEO3K[1]["images"] and table[1]["data_source"] == "hiyouga/geometry3k"
    assert table[1]["reward_model"] == {"style": "rule", "ground_truth": "12.5"} and table[1]["ability"] == "math"
    assert table[1]["extra_info"] == {"split": "train", "index": 1, "answer": "12.5",
                                      "question": "<image>Find the area of the figure."}
    model = ModelConfig(path="builtin:tiny-qwen2.5-vl")
    hf = hf_config(model)
    data = load_prompts(DataConfig(train_files=(str(tmp_path / "out" / "train.parquet"),)),
                        load_tokenizer(model), images=model_image_processor(model.path, hf))
    assert [it.images.tokens_per_image for it in data.items] == [(4,), (6,)]
    assert [list(it.token_ids).count(hf["image_token_id"]) for it in data.items] == [4, 6]
    truth = data.items[1]
    assert b.auto("", "<think>half of 5 x 5</think> so \\boxed{12.5}", truth.answer,
                  {"data_source": truth.data_source})["score"] == 1.0
    pq.write_table(pa.Table.from_pylist([{**GEO3K[0], "problem": "Find x."}]), tmp_path / "bad.parquet")
    with pytest.raises(UserError, match=r"bad.parquet split 'bad' row 0: 0 <image> mark\(s\) in 'problem' for 1 image"):
        prepare.prepare_shaped("geo3k", str(tmp_path / "bad.parquet"), str(tmp_path / "o"))
