"""`mrl sft`: masks, the loss against `transformers`, memorisation, TP2 = TP1, PP2 = PP1 (full and LoRA), exact resume (fp32, bf16)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_util import REPO, run_torchrun
from tests.sft.conftest import CHATS, sft_job
from tests.train.test_train import run_jobs

ENV = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}


def mrl(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "mrl", *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def history(run_dir: Path) -> dict[str, dict[int, float]]:
    """metric -> {step: value} of the MLflow run named after `run_dir` in its output directory's store."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.parent / 'mlflow.db'}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
            if r.info.run_name == run_dir.name]
    assert len(runs) == 1
    return {k: {m.step: m.value for m in client.get_metric_history(runs[0].info.run_id, k)} for k in runs[0].data.metrics}


# ---- data: which tokens are trained ---------------------------------------------------------------

def _decode_masked(ex, tok, want: int) -> str:
    ids = [t for t, m in zip(ex.response_ids, ex.loss_mask) if m == want]
    return tok.decode(ids)


def test_multi_turn_chat_trains_on_every_assistant_turn_and_nothing_else():
    from mrl.models.tokenizer import byte_tokenizer
    from mrl.sft.data import example_from_row

    tok = byte_tokenizer()
    messages = [{"role": "system", "content": "sys"}] + CHATS[1]   # 3+4 = 7, doubled 14
    ex = example_from_row(messages, None, tok, fmt="messages", chat_template=True, system_prompt=None, origin="row 0")
    assert _decode_masked(ex, tok, 1) == "7<|im_end|>\n14<|im_end|>\n"
    prompt = tok.decode(ex.prompt_ids)
    assert prompt == "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    assert _decode_masked(ex, tok, 0) == "<|im_start|>user\ndouble it<|im_end|>\n<|im_start|>assistant\n"
    full = tok.apply_chat_template(messages, tokenize=False)
    assert tok.decode(ex.prompt_ids + ex.response_ids) == full   # nothing lost or reordered
    # a trailing user turn is context for nothing: dropped
    ex2 = example_from_row(messages + [{"role": "user", "content": "bye"}], None, tok, fmt="messages",
                           chat_template=True, system_prompt=None, origin="row 1")
    assert ex2 == ex.__class__(ex.prompt_ids, ex.response_ids, ex.loss_mask, "row 1")


def test_prompt_response_rows_train_on_the_response_and_eos():
    from mrl.models.tokenizer import byte_tokenizer
    from mrl.sft.data import example_from_row

    tok = byte_tokenizer()
    raw = example_from_row("2+2=", "4", tok, fmt="prompt_response", chat_template=False, system_prompt=None, origin="r")
    assert tok.decode(raw.prompt_ids) == "2+2=" and raw.response_ids == [ord("4"), tok.eos_token_id]
    assert raw.loss_mask == [1, 1]
    chat = example_from_row("2+2=", "4", tok, fmt="prompt_response", chat_template=True, system_prompt="be brief",
                            origin="r")
    assert _decode_masked(chat, tok, 1) == "4<|im_end|>\n" and 0 not in chat.loss_mask
    assert tok.decode(chat.prompt_ids).startswith("<|im_start|>system\nbe brief<|im_end|>")


def test_a_template_that_rewrites_earlier_turns_is_an_error_not_a_wrong_mask():
    from mrl.errors import UserError
    from mrl.models.tokenizer import byte_tokenizer
    from mrl.sft.data import example_from_row

    import copy

    tok = copy.deepcopy(byte_tokenizer())
    # shows only the last two messages: earlier turns vanish as the conversation grows
    tok.chat_template = ("{% for m in messages[-2:] %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(UserError, match="row 3: the chat template does not render this conversation incrementally"):
        example_from_row(CHATS[0], None, tok, fmt="messages", chat_template=True, system_prompt=None, origin="row 3")


def test_too_long_examples_follow_sft_truncation(tmp_path, tiny_hf, pairs_parquet):
    from mrl.config.loader import load
    from mrl.errors import UserError
    from mrl.sft.data import load_examples
    from mrl.models.tokenizer import byte_tokenizer

    job = sft_job(tmp_path, str(tiny_hf), pairs_parquet)
    tok = byte_tokenizer()
    # chat template on: 21 template tokens + prompt + response bytes (26 to 44 tokens here)
    spec, _ = load(job, ["sft.max_tokens=26"])
    with pytest.raises(UserError, match=r"pairs.parquet row 1: 44 tokens, more than sft.max_tokens 26"):
        load_examples(spec, tok)
    spec, _ = load(job, ["sft.max_tokens=26", "sft.truncation=drop"])
    kept = load_examples(spec, tok)
    assert kept.stats["examples_too_long_dropped"] == 4 and len(kept) == 4
    spec, _ = load(job, ["sft.max_tokens=40", "sft.truncation=right"])
    cut = load_examples(spec, tok)
    assert cut.stats["examples_truncated"] == 2 and len(cut) == 8 and max(e.tokens for e in cut.examples) == 40


def test_sft_build_says_its_start_up_phases_with_durations(tmp_path, tiny_hf, pairs_parquet, monkeypatch):
    """`mrl sft` says the phases `mrl train` says: process groups, data, model (its weights loaded)."""
    import io

    from mrl import platform
    from mrl.config.loader import load
    from mrl.sft.loop import build
    from mrl.tracking import startup

    out = io.StringIO()
    monkeypatch.setattr(startup, "STARTUP", startup.StartupLog(out, rank_zero=True))
    spec, _ = load(sft_job(tmp_path, str(tiny_hf), pairs_parquet), ["platform.cpu_threads=1"])
    try:
        build(spec)
    finally:
        platform.teardown()
    lines = out.getvalue().splitlines()
    phases = [re.sub(r" \(\d+\.\ds\)", " (T)", line) for line in lines if not line.startswith("loading ")]
    assert phases == ["process groups (T): world 1, TP 1 x PP 1 x DP 1",
                      f"data (T): 8 training examples, tokenizer of {tiny_hf}",
                      f"model (T): {tiny_hf}"], lines
    assert any(re.fullmatch(r"loading actor weights (\d+)/\1 \(\d+\.\ds\)", line) for line in lines), lines


# ---- the spec ---------------------------------------------------------------------------------

def test_sft_spec_errors_name_the_key(tmp_path, tiny_hf, pairs_parquet):
    from mrl.config.loader import load
    from mrl.errors import SpecError

    job = sft_job(tmp_path, str(tiny_hf), pairs_parquet)
    with pytest.raises(SpecError) as e:
        load(job, ["data.prompts_per_step=4", "sft.examples_per_step=3", "platform.ranks_per_node=2",
                   "sft.micro_batch_tokens=64", "rollout.temperature=1.0", "data.train_batch_size=8"])
    text = "\n".join(e.value.problems)
    assert "rollout.temperature: unknown key" in text
    assert "data.train_batch_size: unknown key; did you mean `sft.examples_per_step`?" in text   # verl's SFT name
    assert "data.prompts_per_step: is not read by mrl sft" in text
    assert "sft.examples_per_step: 3 examples do not split evenly over data-parallel size 2" in text
    assert "sft.micro_batch_tokens: 64 tokens cannot hold one example of sft.max_tokens 96" in text


def test_verl_sft_tables_target_real_keys_are_documented_and_explained(tmp_path, tiny_hf, pairs_parquet):
    """Every verl SFT key maps to a key an SFT job has, or has a reason; CONTRIBUTING.md lists both
    tables; an SFT job using one gets the suggestion or the reason in one line."""
    from mrl.schema.section import all_keys
    from mrl.config.loader import load
    from mrl.errors import SpecError
    from mrl.config.sft_job import SFTJobSpec
    from mrl.sft.config import VERL_SFT_NOT_APPLICABLE, VERL_SFT_TO_MRL

    valid = set(all_keys(SFTJobSpec))
    assert not [v for v in VERL_SFT_TO_MRL.values() if v not in valid]
    assert not set(VERL_SFT_NOT_APPLICABLE) & set(VERL_SFT_TO_MRL)
    text = (REPO / "CONTRIBUTING.md").read_text()
    assert not [k for k, v in VERL_SFT_TO_MRL.items() if f"| `{k}` | `{v}` |" not in text]
    assert not [k for k in VERL_SFT_NOT_APPLICABLE if f"| `{k}` |" not in text]
    job = sft_job(tmp_path, str(tiny_hf), pairs_parquet)
    with pytest.raises(SpecError) as e:
        load(job, ["trainer.max_ckpt_to_keep=2", "model.lora.rank=8", "model.lora_adapter_path=x",
                   "model.exclude_modules=x"])
    text = "\n".join(e.value.problems)
    assert "trainer.max_ckpt_to_keep: unknown key; did you mean `checkpoint.keep_last`?" in text
    assert "model.lora.rank: unknown key; did you mean `sft.lora.rank`?" in text
    assert "model.lora_adapter_path: unknown key; did you mean `sft.lora.adapter_path`?" in text
    assert "model.exclude_modules: not an mrl key: adapters go only on the modules listed" in text


def test_mrl_train_refuses_an_sft_job_and_mrl_sft_an_rl_job(tmp_path, tiny_hf, pairs_parquet):
    job = sft_job(tmp_path, str(tiny_hf), pairs_parquet)
    proc = mrl("train", job)
    assert proc.returncode == 2 and "an SFT job (it has an [sft] section): run it with `mrl sft`" in proc.stderr
    proc = mrl("sft", REPO / "jobs/quickstart_cpu.toml")
    assert proc.returncode == 2 and "not an SFT job (no [sft] section)" in proc.stderr
    assert proc.stdout == f"mrl sft {REPO / 'jobs/quickstart_cpu.toml'}: checking the job\n"   # as `mrl train` starts


# ---- training ---------------------------------------------------------------------------------

def _loss_result(job, *overrides, nproc: int = 1) -> dict:
    script = REPO / "tests/sft/scripts/sft_loss.py"
    if nproc == 1:
        proc = subprocess.run([sys.executable, str(script), str(job), *overrides], cwd=REPO, capture_output=True,
                              text=True, timeout=300, env=ENV)
        assert proc.returncode == 0, proc.stderr[-4000:]
    else:
        proc = run_torchrun(script, str(job), *overrides, nproc=nproc)
    return json.loads(re.search(r"^RESULT (.*)$", proc.stdout, re.M).group(1))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["prompt_response", "messages"])
def test_loss_equals_transformers_cross_entropy(tmp_path, tiny_hf, pairs_parquet, chats_parquet, fmt):
    """fp32, the step split into several packed micro-batches; the mask of the chat format too."""
    data = pairs_parquet if fmt == "prompt_response" else chats_parquet
    job = sft_job(tmp_path, str(tiny_hf), data, fmt=fmt)
    r = _loss_result(job, "sft.micro_batch_tokens=96", "sft.examples_per_step=8")
    assert r["micro_batches"] >= 2 and r["tokens"] > 8
    assert abs(r["engine"] - r["hf"]) <= 1e-5, r


@pytest.mark.slow
def test_loss_at_tp2_and_dp2_equals_transformers(tmp_path, tiny_hf, chats_parquet):
    job = sft_job(tmp_path, str(tiny_hf), chats_parquet, fmt="messages", ranks=2, tensor=2)
    r = _loss_result(job, "sft.micro_batch_tokens=96", "sft.examples_per_step=8", nproc=2)
    assert abs(r["engine"] - r["hf"]) <= 1e-5, r
    r = _loss_result(job, "parallel.tensor=1", "sft.micro_batch_tokens=96", "sft.examples_per_step=8", nproc=2)
    assert abs(r["engine"] - r["hf"]) <= 1e-5, r


@pytest.mark.slow
def test_a_tiny_model_memorises_a_small_set(tmp_path, tiny_hf, pairs_parquet):
    job = sft_job(tmp_path, str(tiny_hf), pairs_parquet, extra="[checkpoint]\nevery_steps = 0\n")
    proc = mrl("sft", job, "sft.total_steps=60", "sft.optim.lr=3e-3", "sft.examples_per_step=8",
               "data.shuffle=false", "checkpoint.save_hf_at_end=true")
    assert proc.returncode == 0, proc.stderr[-4000:]
    loss = history(tmp_path / "runs/sft")["train/loss"]
    assert loss[1] > 3.0 and loss[60] < 0.05, (loss[1], loss[60])
    # the finished run's Hugging Face export is an `mrl train` model: it still knows the set
    hf_dir = tmp_path / "runs/sft/hf/step_60"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    text = tok.apply_chat_template([{"role": "user", "content": "2+2="}], add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=2, do_sample=False)[0, ids.shape[1]:]
    assert tok.decode(out) == "4<|im_end|>"
    # ... and starts an RL job: one GRPO step of the quickstart from it
    proc = mrl("train", REPO / "jobs/quickstart_cpu.toml", f"model.path={hf_dir}", "platform.ranks_per_node=1",
               "parallel.tensor=1", "trainer.total_steps=1", f"job.output_dir={tmp_path / 'rl'}", "tracking.backends=[]",
               "checkpoint.every_steps=0")
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.slow
def test_tp2_trains_like_tp1(tmp_path, tiny_hf, chats_parquet):
    job = sft_job(tmp_path, str(tiny_hf), chats_parquet, fmt="messages", ranks=2, tensor=2, name="tp2",
                  val=chats_parquet)
    common = ["sft.total_steps=3", "sft.val_every_steps=3", "checkpoint.every_steps=0"]
    run_torchrun("-m mrl", "sft", str(job), *common)
    proc = mrl("sft", job, *common, "platform.ranks_per_node=1", "parallel.tensor=1", "job.name=tp1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    tp2, tp1 = history(tmp_path / "runs/tp2"), history(tmp_path / "runs/tp1")
    for key in ("train/loss", "train/grad_norm", "val/loss"):
        for step, v in tp1[key].items():
            assert abs(tp2[key][step] - v) <= 1e-5 * max(1.0, abs(v)), (key, step, tp2[key][step], v)
    assert tp1["train/loss"][3] < tp1["train/loss"][1]


@pytest.mark.slow
def test_pp2_trains_like_pp1_full_and_lora(tmp_path, tiny_hf, chats_parquet):
    """3 SFT steps at pipeline 2 (one decoder layer per stage) = at pipeline 1 (the same 2 ranks
    data-parallel): per-step loss and grad norm and the validation loss after, for full fine-tuning
    and for LoRA adapters on every projection (whose trained values, gathered from both stages,
    match too, as do the PEFT adapter directories written at each layout)."""
    job = sft_job(tmp_path, str(tiny_hf), chats_parquet, fmt="messages", ranks=2, val=chats_parquet)
    proc = run_torchrun(REPO / "tests/sft/scripts/pp_equivalence.py", str(job), "3", str(tmp_path), "sft.val_every_steps=3",
                        "checkpoint.every_steps=0", "tracking.backends=[]")
    r = json.loads(re.search(r"^RESULT (.*)$", proc.stdout, re.M).group(1))
    for kind in ("full", "lora"):
        pp2, pp1 = r[f"{kind}_pp2"], r[f"{kind}_pp1"]
        for key in ("loss", "grad_norm"):
            for a, b in zip(pp2[key], pp1[key], strict=True):
                assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (kind, key, pp2[key], pp1[key])
        assert abs(pp2["val_loss"] - pp1["val_loss"]) <= 1e-5 * pp1["val_loss"], (kind, pp2["val_loss"], pp1["val_loss"])
        assert pp1["loss"][2] < pp1["loss"][0], (kind, pp1["loss"])
    assert r["full_pp1"]["adapters"] == {} and abs(r["lora_pp1"]["loss"][2] - r["full_pp1"]["loss"][2]) > 1e-3
    a2, a1 = r["lora_pp2"]["adapters"], r["lora_pp1"]["adapters"]
    assert sorted(a2) == sorted(a1) and len(a1) == 28   # 2 layers x 7 projections x (A, B)
    for name in a1:
        assert torch.allclose(torch.tensor(a2[name]), torch.tensor(a1[name]), atol=1e-6, rtol=1e-5), name
    assert all(torch.tensor(a1[n]).abs().max() > 1e-4 for n in a1 if ".lora.B." in n)   # B left zero: trained
    # the PEFT export at PP2 (each stage's layer gathered by the exporter) = at PP1 = the trained adapters
    from safetensors.torch import load_file

    f2, f1 = (load_file(str(tmp_path / f"peft_pp{pp}/adapter_model.safetensors")) for pp in (2, 1))
    assert sorted(f2) == sorted(f1) and len(f1) == 28
    for name in f1:
        assert torch.allclose(f2[name], f1[name], atol=1e-6, rtol=1e-5), name
    assert torch.equal(f2["base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"],   # from stage 2
                       torch.tensor(a2["decoder.layers.1.mlp.linear_fc1.lora.B.up_proj"]))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resume_continues_exactly(tmp_path, tiny_hf, pairs_parquet, dtype):
    """4 steps straight = 2 steps, a checkpoint, then a resumed run to 4 (loss, grad norm, val loss).
    The three runs share one process (`run_jobs.py`: one `sft()` after another)."""
    job = sft_job(tmp_path, str(tiny_hf), pairs_parquet, val=pairs_parquet, name="straight")
    common = f"model.dtype={dtype} sft.val_every_steps=2 checkpoint.every_steps=2"
    run_jobs(str(job), tmp_path / "runs", f"{common} sft.total_steps=4 job.name=straight",
             f"{common} sft.total_steps=2 job.name=resumed", f"{common} sft.total_steps=4 job.name=resumed")
    straight, resumed = history(tmp_path / "runs/straight"), history(tmp_path / "runs/resumed")
    for key in ("train/loss", "train/grad_norm", "val/loss"):
        assert straight[key] == resumed[key], key
    assert sorted(resumed["train/loss"]) == [1, 2, 3, 4]
