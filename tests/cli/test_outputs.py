"""Where commands may write (`mrl.outputs.check_output`): a property test over path shapes (links,
`..`, files where directories are expected, checkpoint roots, inputs, existing outputs) against
an independent oracle, and each command that writes: `mrl data`, `mrl generate --out`,
`mrl eval --json`, `mrl convert -o`, `mrl merge`; `mrl generate`'s prompts file and prompt size."""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mrl.cli import main
from mrl.errors import UserError
from mrl.outputs import check_output

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree")
    (root / "ckpt" / "step_00000001").mkdir(parents=True)
    (root / "ckpt" / "latest").write_text("step_00000001\n")
    (root / "ckpt" / "step_00000001" / "common.pt").write_bytes(b"x")
    (root / "data").mkdir()
    (root / "data" / "train.parquet").write_bytes(b"x")
    (root / "file.txt").write_text("x")
    (root / "dir").mkdir()
    (root / "link_to_input").symlink_to(root / "data" / "train.parquet")
    (root / "link_to_ckpt").symlink_to(root / "ckpt" / "step_00000001")
    return root


PARTS = ["ckpt", "step_00000001", "common.pt", "data", "train.parquet", "file.txt", "dir", "new", "link_to_input",
         "link_to_ckpt", "..", "."]


def _refused(tree: Path, rel: str, kind: str, force: bool) -> bool:
    """The oracle: whether writing `rel` must be refused, worked out with os.path alone."""
    real = os.path.realpath(os.path.join(tree, rel))
    parent = os.path.dirname(real)
    while parent != os.path.dirname(parent):
        if os.path.exists(parent) and not os.path.isdir(parent):
            return True
        parent = os.path.dirname(parent)
    if kind == "dir" and os.path.exists(real) and not os.path.isdir(real):
        return True
    if kind == "file" and os.path.isdir(real):
        return True
    ckpt = os.path.realpath(os.path.join(tree, "ckpt"))
    if real == ckpt or real.startswith(ckpt + os.sep):
        return True
    target = os.path.join(real, "out.parquet") if kind == "dir" else real
    if target == os.path.realpath(os.path.join(tree, "data", "train.parquet")):
        return True
    data = os.path.realpath(os.path.join(tree, "data"))
    if os.path.exists(target) and target.startswith(data + os.sep):
        return True
    return os.path.exists(target) and not force


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.sampled_from(PARTS), min_size=1, max_size=4), kind=st.sampled_from(["file", "dir"]),
       force=st.booleans())
def test_every_path_shape_is_refused_exactly_when_the_oracle_says(tree, parts, kind, force):
    rel = os.path.join(*parts)
    try:
        check_output(tree / rel, what="out", kind=kind, force=force, inputs=[tree / "data" / "train.parquet"],
                     sources=[tree / "data"], writes=["out.parquet"] if kind == "dir" else ())
        refused = False
    except UserError as e:
        assert "\n" not in str(e) and str(e).startswith("out ")
        refused = True
    assert refused == _refused(tree, rel, kind, force), rel


# --- mrl data -----------------------------------------------------------------------------------

def _gsm8k(src: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    src.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([{"question": "1+1?", "answer": "so #### 2"}]), src / "train.parquet")


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_mrl_data_never_writes_over_its_source(tmp_path, capsys):
    src = tmp_path / "gsm8k"
    _gsm8k(src)
    before = (src / "train.parquet").read_bytes()
    for force in ([], ["--force"]):
        assert main(["data", "gsm8k", str(src), str(src), *force]) == 2
        assert "a file of the source data" in one_error_line(capsys)
    assert (src / "train.parquet").read_bytes() == before


def test_mrl_data_refuses_an_existing_output_unless_forced_and_a_file_as_out(tmp_path, capsys):
    out = tmp_path / "gym"
    args = ["data", "gym", "chain_sum", str(out), "--train-size", "4", "--test-size", "2"]
    assert main(args) == 0
    capsys.readouterr()
    first = (out / "train.parquet").read_bytes()
    assert main([*args[:4], "--train-size", "5", "--test-size", "2"]) == 2
    assert "already exists; pass --force" in one_error_line(capsys)
    assert (out / "train.parquet").read_bytes() == first
    assert main([*args[:4], "--train-size", "5", "--test-size", "2", "--force"]) == 0
    capsys.readouterr()
    (tmp_path / "afile").write_text("x")
    assert main(["data", "gym", "chain_sum", str(tmp_path / "afile"), "--train-size", "4"]) == 2
    assert "is a file; expected a directory" in one_error_line(capsys)


@pytest.mark.parametrize("flag", ["--train-size", "--test-size"])
def test_negative_sizes_are_refused_by_the_parser(tmp_path, capsys, flag):
    with pytest.raises(SystemExit) as e:
        main(["data", "gym", "chain_sum", str(tmp_path / "o"), flag, "-5"])
    assert e.value.code == 2 and "-5: must be >= 0" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_both_sizes_zero_is_one_line(tmp_path, capsys):
    assert main(["data", "gym", "chain_sum", str(tmp_path / "o"), "--train-size", "0", "--test-size", "0"]) == 2
    assert "nothing to write" in one_error_line(capsys)


# --- mrl generate, eval, convert, merge ---------------------------------------------------------

def _ckpt(tmp_path) -> Path:
    root = tmp_path / "run" / "checkpoints" / "actor"
    (root / "step_00000002").mkdir(parents=True)
    (root / "latest").write_text("step_00000002\n")
    (root / "step_00000002" / "common.pt").write_bytes(b"precious")
    return root


def test_generate_out_onto_a_checkpoint_file_is_refused(tmp_path, capsys):
    root = _ckpt(tmp_path)
    common = root / "step_00000002" / "common.pt"
    assert main(["generate", str(REPO / "jobs/quickstart_cpu.toml"), "--prompt", "hi", "--out", str(common)]) == 2
    assert f"is inside the checkpoint root {root}" in one_error_line(capsys)
    assert common.read_bytes() == b"precious"


def test_generate_out_onto_its_prompts_or_an_existing_file(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"hi"\n')
    job = str(REPO / "jobs/quickstart_cpu.toml")
    assert main(["generate", job, "--prompts", str(prompts), "--out", str(prompts), "--force"]) == 2
    assert "is an input of this command" in one_error_line(capsys)
    (tmp_path / "old.jsonl").write_text("old")
    assert main(["generate", job, "--prompt", "hi", "--out", str(tmp_path / "old.jsonl")]) == 2
    assert "already exists; pass --force" in one_error_line(capsys)
    assert main(["eval", job, "--json", str(tmp_path / "old.jsonl")]) == 2
    assert "already exists; pass --force" in one_error_line(capsys)


@pytest.mark.parametrize("content, why", [
    (b'"hi"\n"\xff\xfe caf\xe9"\n', "p.jsonl:2: not UTF-8 text (byte"),
    (b"\x7fELF\x02\x01\x01\x00\x00\x00", "a NUL byte"),
])
def test_a_binary_prompts_file_is_one_line(tmp_path, capsys, content, why):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(content)
    assert main(["generate", str(REPO / "jobs/quickstart_cpu.toml"), "--prompts", str(prompts)]) == 2
    assert why in one_error_line(capsys)


class NoTokenizing:
    model_max_length = 10**30   # what HF says when the model states none

    def __call__(self, *a, **kw):
        raise AssertionError("an oversized prompt must not be tokenized")

    apply_chat_template = __call__


@pytest.mark.parametrize("prompt", ["x" * (2 << 20), [{"role": "user", "content": "é" * (1 << 20)}]])
def test_an_oversized_prompt_is_refused_before_tokenizing(prompt):
    from mrl.offline.generate import BYTES_PER_TOKEN, Request, _items

    run = SimpleNamespace(spec=SimpleNamespace(data=SimpleNamespace(max_prompt_tokens=512, chat_template=True,
                                                                    system_prompt=None)),
                          tokenizer=NoTokenizing())
    with pytest.raises(UserError, match=rf"prompt 0 \(.*\) has \d+ bytes, more than {512 * BYTES_PER_TOKEN} "):
        _items(run, [Request(prompt), Request("x" * 10)])


def test_convert_out_onto_its_input_is_refused(tmp_path, capsys):
    src = tmp_path / "ppo.yaml"
    src.write_text("algorithm:\n  adv_estimator: grpo\n")
    assert main(["convert", str(src), "-o", str(src), "--force"]) == 2
    assert "is an input of this command" in one_error_line(capsys)
    assert src.read_text() == "algorithm:\n  adv_estimator: grpo\n"


def test_merge_into_its_own_checkpoint_or_a_file_parent_is_one_line(tmp_path, capsys):
    root = _ckpt(tmp_path)
    (tmp_path / "f").write_text("x")
    assert main(["merge", str(root), str(tmp_path / "f" / "hf")]) == 2
    assert "is a file, not a directory" in one_error_line(capsys)


def test_compare_out_into_a_checkpoint_or_onto_a_file_is_one_line(tmp_path, capsys):
    root = _ckpt(tmp_path)
    assert main(["compare", str(tmp_path / "run"), "--out", str(root / "plots")]) == 2
    assert f"is inside the checkpoint root {root}" in one_error_line(capsys)
    (tmp_path / "f").write_text("x")
    assert main(["compare", str(tmp_path / "run"), "--out", str(tmp_path / "f")]) == 2
    assert "is a file; expected a directory" in one_error_line(capsys)


def test_an_oversized_prompt_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import mrl.offline.session as session

    def no_session(*a, **kw):
        raise AssertionError("the model must not load for an oversized prompt")

    monkeypatch.setattr(session, "session", no_session)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps("hi") + "\n" + json.dumps({"prompt": "y" * (3 << 20)}) + "\n")
    assert main(["generate", str(REPO / "jobs/quickstart_cpu.toml"), "--prompts", str(prompts)]) == 2
    assert "generate: prompt 1 ('yyyy" in one_error_line(capsys)
