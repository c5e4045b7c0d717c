"""`mrl eval` and `mrl generate`: a checkpoint's policy validated and sampled in one process.

Fast: the command-line errors (one line, exit 2) before any model is built. Slow (one short
single-process training of the quickstart): `mrl eval` reproduces the val/* metrics the training
loop logged at the same step, and `mrl generate` uses the checkpoint's weights."""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_cli import ENV, REPO

ONE_RANK = ["platform.ranks_per_node=1", "parallel.tensor=1", "reward.workers=1"]
VAL = ["trainer.val_every_steps=2", "data.val_prompts=16", "rollout.validation.do_sample=true",
       "rollout.validation.temperature=1.0", "rollout.validation.responses_per_prompt=2"]


def mrl(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "mrl", *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def one_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# --------------------------------------------------------------------------- fast: bad inputs


def test_step_without_a_checkpoint_is_one_line(cli, tmp_path):
    rc, _, err = cli("eval", "jobs/quickstart_cpu.toml", f"job.output_dir={tmp_path}", "--step", "3")
    assert rc == 2 and "--step 3: no checkpoint at" in one_error(err) and "no checkpoint saved there" in err


def test_missing_prompts_file_is_one_line(cli, tmp_path):
    rc, _, err = cli("generate", "jobs/quickstart_cpu.toml", "--prompts", tmp_path / "none.jsonl")
    assert rc == 2 and "none.jsonl: no such file" in one_error(err)


def test_a_bad_prompts_line_is_named(cli, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"fine"\n{"text": "no prompt key"}\n')
    rc, _, err = cli("generate", "jobs/quickstart_cpu.toml", "--prompts", prompts)
    assert rc == 2 and f"{prompts}:2: expected a string" in one_error(err)


def test_prompt_prompts_and_from_data_are_one_of(cli, tmp_path):
    # with none of them, the job's data is used (the slow test below); two at once are refused
    rc, _, err = cli("generate", "jobs/quickstart_cpu.toml", "--prompt", "hi", "--from-data", "4")
    assert rc == 2 and "one of --prompt TEXT, --prompts FILE.jsonl or --from-data [N], got --prompt TEXT and " \
                       "--from-data [N]" in one_error(err)
    rc, _, err = cli("generate", "jobs/quickstart_cpu.toml", "--prompt", "hi", "--split", "val")
    assert rc == 2 and "--split picks the job's data" in one_error(err)
    rc, _, err = cli("generate", "jobs/quickstart_cpu.toml", "--from-data", "0")
    assert rc == 2 and "--from-data 0: must be >= 1" in one_error(err)


def test_from_data_defaults_to_the_held_out_prompts_when_there_are_some():
    from mrl.config.loader import load
    from mrl.errors import UserError
    from mrl.offline.generate import DATA_PROMPTS, FromData, from_data

    spec, _ = load(REPO / "jobs/quickstart_cpu.toml")   # a generator: it has validation prompts
    assert from_data(spec, None, None) == FromData(DATA_PROMPTS, "val")
    assert from_data(spec, 3, "train") == FromData(3, "train")
    # training files only: the training data
    files = dataclasses.replace(spec, data=dataclasses.replace(spec.data, generator=None, train_files=("t.parquet",)))
    assert from_data(files, None, None) == FromData(DATA_PROMPTS, "train")
    with pytest.raises(UserError, match="no validation data"):
        from_data(files, 2, "val")


def test_rows_are_written_as_jsonl_or_parquet(tmp_path):
    import pyarrow.parquet as pq

    from mrl.offline.generate import write_rows

    rows = [{"index": 0, "prompt": "plain", "response": "1", "score": 1.0, "answer": "1"},
            {"index": 1, "prompt": [{"role": "user", "content": "hi"}], "response": "x", "score": 0.0, "answer": 7}]
    write_rows(rows, tmp_path / "r.jsonl")
    assert [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()] == rows
    write_rows(rows, tmp_path / "r.parquet")
    back = pq.read_table(tmp_path / "r.parquet").to_pylist()
    # text and chat-message prompts share no Arrow type: the column holds JSON text for the messages
    assert [r["prompt"] for r in back] == ["plain", '[{"role": "user", "content": "hi"}]']
    assert [r["answer"] for r in back] == ["1", "7"] and [r["score"] for r in back] == [1.0, 0.0]


def test_a_directory_that_is_not_a_run_is_refused(cli, tmp_path):
    rc, _, err = cli("eval", tmp_path)
    assert rc == 2 and "is not a run directory" in one_error(err)


def test_bad_sampling_override_is_one_line(cli):
    rc, _, err = cli("generate", "jobs/quickstart_cpu.toml", "--prompt", "hi", "-n", "0")
    assert rc == 2 and "-n 0: must be >= 1" in one_error(err)


def test_overrides_may_follow_the_options(cli, tmp_path):
    rc, _, err = cli("eval", "jobs/quickstart_cpu.toml", "--step", "1", f"job.output_dir={tmp_path}")
    assert rc == 2 and str(tmp_path) in one_error(err)   # the override was applied, not refused by argparse


# --------------------------------------------------------------------------- slow: a real checkpoint


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step single-process quickstart run validating at step 2, checkpointing every step."""
    out = tmp_path_factory.mktemp("evalgen")
    proc = mrl("train", "jobs/quickstart_cpu.toml", f"job.output_dir={out}", *ONE_RANK, *VAL,
               "tracking.backends=[\"console\"]", "trainer.total_steps=2", "checkpoint.every_steps=1",
               "checkpoint.keep_last=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = re.search(r"val reward last ([0-9.]+) \(step 2\)", proc.stdout + proc.stderr)
    assert logged, proc.stdout[-2000:]
    return out / "quickstart-cpu", float(logged.group(1))


@pytest.mark.slow
def test_eval_and_generate_use_the_checkpoint(trained, tmp_path):
    run_dir, logged_val_reward = trained
    # eval of the latest checkpoint (step 2) = the validation the training loop ran at step 2
    proc = mrl("eval", run_dir, "--json", tmp_path / "val.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "val.json").read_text())
    assert report["step"] == 2 and "val/reward_mean" in proc.stdout
    assert report["metrics"]["val/responses"] == 32
    assert report["metrics"]["val/reward_mean"] == pytest.approx(logged_val_reward, rel=1e-3)
    assert len(report["samples"]["prompt"]) > 0   # validation's sample rows
    # no checkpoint at the step asked for: one line, exit 2
    proc = mrl("eval", run_dir, "--step", "9")
    assert proc.returncode == 2 and "steps saved: 1, 2" in one_error(proc.stderr)

    # generate: greedy responses of the step-2 weights differ from the job's initial model's
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"Write 3 in digits:"\n{"prompt": "Write nine in digits:"}\n')
    greedy = ["--prompts", prompts, "--temperature", "0", "--max-tokens", "4", "-n", "1"]
    proc = mrl("generate", run_dir, *greedy, "--out", tmp_path / "step2.jsonl")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "step2.jsonl").read_text().splitlines()]
    assert [(r["index"], r["step"], r["response_tokens"]) for r in rows] == [(0, 2, 4), (1, 2, 4)]
    assert rows[1]["prompt"] == "Write nine in digits:"
    proc = mrl("generate", "jobs/quickstart_cpu.toml", f"job.output_dir={tmp_path / 'fresh'}", *greedy)
    assert proc.returncode == 0, proc.stderr[-3000:]
    initial = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["step"] for r in initial] == [0, 0]
    assert [r["response"] for r in initial] != [r["response"] for r in rows]

    # the job's own prompts (its validation prompts: the generator's), scored with the job's reward
    proc = mrl("generate", run_dir, "--from-data", "4", "-n", "2", "--out", tmp_path / "data.parquet")
    assert proc.returncode == 0 and "wrote 8 responses" in proc.stdout, proc.stderr[-3000:]
    import importlib.util

    import pyarrow.parquet as pq

    found = importlib.util.spec_from_file_location("digits", REPO / "jobs/tasks/digits.py")
    digits = importlib.util.module_from_spec(found)
    found.loader.exec_module(digits)
    rows = pq.read_table(tmp_path / "data.parquet").to_pylist()
    assert [(r["index"], r["sample"], r["step"]) for r in rows] == [(i, j, 2) for i in range(4) for j in range(2)]
    for r in rows:
        assert r["score"] == pytest.approx(digits.score(r["prompt"], r["response"], r["answer"], {})["score"]), r


def test_a_merged_builtin_preset_stops_where_its_training_engine_stops(tmp_path):
    """mrl merge gives a builtin preset's output the byte tokenizer's EOS (256) in config.json and
    generation_config.json; the training engine, built from the preset, stops at none. The session's
    copy is set back to the preset's, so mrl eval draws what the run's validation drew (with EOS
    256, a response that sampled 256 ended there: step 2 of the slow test below, 0.0586 vs 0.0625)."""
    from transformers import GenerationConfig

    from mrl.models.facts import find_hf_config
    from mrl.offline.session import stop_as_training
    from mrl.rollout.hf import HFEngine

    preset = find_hf_config("builtin:tiny-qwen2")[0]
    merged = HFEngine.from_config(preset).model
    merged.config.eos_token_id = 256
    merged.save_pretrained(tmp_path)
    GenerationConfig(eos_token_id=256, pad_token_id=256).save_pretrained(tmp_path)
    assert HFEngine.from_pretrained(str(tmp_path)).eos_token_ids == (256,)
    stop_as_training(tmp_path, preset.get("eos_token_id"))
    assert "eos_token_id" not in json.loads((tmp_path / "config.json").read_text())
    assert HFEngine.from_pretrained(str(tmp_path)).eos_token_ids == HFEngine.from_config(preset).eos_token_ids == ()
    stop_as_training(tmp_path, 7)   # a preset that names one keeps it
    assert HFEngine.from_pretrained(str(tmp_path)).eos_token_ids == (7,)


def test_generate_samples_as_training_does_one_response_unless_told():
    from mrl.config.loader import load
    from mrl.offline.generate import SamplingOverrides, sampling_of

    spec, _ = load(REPO / "jobs/quickstart_cpu.toml", ["rollout.top_p=0.9"])
    base = sampling_of(spec, SamplingOverrides())
    assert (base.n, base.temperature, base.top_p, base.max_tokens) == (1, 1.0, 0.9, 8)
    told = sampling_of(spec, SamplingOverrides(n=3, temperature=0.0, max_tokens=2))
    assert (told.n, told.temperature, told.top_p, told.max_tokens) == (3, 0.0, 0.9, 2)


def test_prompts_file_takes_strings_and_chat_messages(tmp_path):
    from mrl.offline.generate import read_prompts

    path = tmp_path / "p.jsonl"
    path.write_text('"plain"\n\n{"prompt": [{"role": "user", "content": "hi"}], "other": 1}\n{"prompt": "x"}\n')
    assert read_prompts(path) == ["plain", [{"role": "user", "content": "hi"}], "x"]


def test_prompts_file_rows_may_carry_answers_to_score(tmp_path):
    from mrl.offline.generate import Request, read_requests

    path = tmp_path / "p.jsonl"
    path.write_text('"plain"\n{"prompt": "Write 3 in digits:", "answer": "3", "data_source": "digits"}\n')
    assert read_requests(path) == [Request("plain"), Request("Write 3 in digits:", "3", "digits")]
