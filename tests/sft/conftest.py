"""Fixtures: a tiny random Hugging Face Qwen2 with the byte tokenizer, SFT parquet files, job files."""
from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def make_model(out: Path, seed: int = 0) -> Path:
    from mrl.models.tokenizer import byte_tokenizer
    from tests.weights.archs import make_hf_model

    make_hf_model("qwen2", out, seed=seed, vocab_size=300)   # the byte tokenizer's 259 ids fit
    byte_tokenizer().save_pretrained(str(out))
    return out


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


PAIRS = [("2+2=", "4"), ("capital of France?", "Paris"), ("3*3=", "9"), ("say hi", "hi there"),
         ("7-5=", "2"), ("color of the sky?", "blue"), ("1+6=", "7"), ("opposite of up?", "down")]

CHATS = [[{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)},
          {"role": "user", "content": "double it"}, {"role": "assistant", "content": str(2 * (a + b))}]
         for a, b in [(1, 2), (3, 4), (5, 1), (2, 2), (6, 3), (0, 7), (8, 1), (4, 4)]]


def sft_job(tmp: Path, model: str, train: Path, *, val: Path | None = None, extra: str = "", ranks: int = 1,
            tensor: int = 1, fmt: str = "prompt_response", name: str = "sft") -> Path:
    """A job file for `mrl sft` over `train` (and `val`) under `tmp`."""
    val_line = f'val_files = ["{val}"]\n' if val else ""
    text = f"""[job]
name = "{name}"
output_dir = "{tmp / 'runs'}"
[platform]
device = "cpu"
ranks_per_node = {ranks}
collective_timeout_s = 120
[parallel]
tensor = {tensor}
[model]
path = "{model}"
dtype = "float32"
[data]
train_files = ["{train}"]
{val_line}[sft]
format = "{fmt}"
max_tokens = 96
examples_per_step = 4
micro_batch_tokens = 128
[sft.optim]
lr = 1e-3
weight_decay = 0.0
[tracking]
backends = ["mlflow"]
{extra}
"""
    path = tmp / f"{name}.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("sft_model") / "qwen2")


@pytest.fixture
def pairs_parquet(tmp_path) -> Path:
    return write_parquet(tmp_path / "pairs.parquet", [{"prompt": p, "response": r} for p, r in PAIRS])


@pytest.fixture
def chats_parquet(tmp_path) -> Path:
    return write_parquet(tmp_path / "chats.parquet", [{"messages": m} for m in CHATS])
