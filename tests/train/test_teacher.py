"""The distillation teacher (`mrl.train.build.build_teacher`, `mrl.train.teacher`): a frozen
megatron-core model of its own architecture whose log-probs of the student's tokens equal
transformers' (with the student's tokenizer or, re-encoded, with another), and a one-line refusal
of a teacher with no weights, or another tokenizer with the full-vocabulary estimator."""
from __future__ import annotations

import copy

import pytest
import torch

from mrl.batch import Batch
from mrl.errors import UserError
from mrl.models.tokenizer import byte_tokenizer
from tests.weights.archs import make_hf_model

REPO_JOB = "jobs/quickstart_cpu.toml"


@pytest.fixture(scope="module")
def platform():
    from mrl import platform as plat
    from mrl.platform.config import ParallelConfig, PlatformConfig

    ctx = plat.setup(PlatformConfig(device="cpu", ranks_per_node=1, cpu_threads=1), ParallelConfig(), seed=11)
    yield ctx
    plat.teardown()


def _spec(teacher_dir, *extra):
    from mrl.config.loader import load

    spec, _ = load(REPO_JOB, ["platform.ranks_per_node=1", "parallel.tensor=1", "algorithm.advantage=distill",
                              f"distill.model_path={teacher_dir}", *extra])
    return spec


def _teacher_dir(tmp_path, tokenizer=None):
    # larger than the student (builtin:tiny-qwen2: 2 layers, hidden 128), the student's 512-token vocabulary
    model = make_hf_model("qwen2", tmp_path, seed=3, vocab_size=512, num_hidden_layers=3, hidden_size=96,
                          intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    (tokenizer or byte_tokenizer()).save_pretrained(tmp_path)
    return model


def test_teacher_logprobs_of_student_tokens_equal_transformers(platform, tmp_path):
    from mrl.train.build import build_teacher
    from mrl.train.teacher import teacher_logprobs

    hf_model = _teacher_dir(tmp_path)
    teacher = build_teacher(_spec(tmp_path), "cpu", byte_tokenizer(), 512)
    assert not any(p.requires_grad for c in teacher.engine.chunks for p in c.parameters())
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 259, (n,), generator=g).tolist() for n in (3, 7, 5)]
    responses = [torch.randint(0, 259, (n,), generator=g).tolist() for n in (6, 2, 9)]
    batch = Batch.from_sequences(prompts, responses, group_index=[0, 0, 1])
    for temperature in (1.0, 0.7):
        got, metrics = teacher_logprobs(teacher, batch, budget=24, temperature=temperature, kernels="torch")
        assert metrics == {}   # the student's tokens as they are
        for i, (p, r) in enumerate(zip(prompts, responses)):
            with torch.no_grad():
                logits = hf_model(torch.tensor([p + r])).logits[0, len(p) - 1:len(p) + len(r) - 1]
            want = torch.log_softmax(logits.float() / temperature, -1).gather(-1, torch.tensor(r)[:, None])[:, 0]
            assert (got[i, :len(r)] - want).abs().max().item() <= 1e-5, (i, temperature)
            assert got[i, len(r):].abs().max().item() == 0.0 if len(r) < got.shape[1] else True


def test_a_teacher_with_another_tokenizer_reads_its_own_tokens(platform, tmp_path):
    """The student's text re-encoded by the teacher's tokenizer: the teacher's log-probs of its own
    tokens equal transformers' on those ids (1e-5), shared back over each chunk's student tokens."""
    from mrl.train.build import build_teacher
    from mrl.train.retokenize import align
    from mrl.train.teacher import teacher_logprobs
    from tests.train.merged_tokenizer import merged_tokenizer

    s = byte_tokenizer()
    hf_model = _teacher_dir(tmp_path, tokenizer=merged_tokenizer())
    teacher = build_teacher(_spec(tmp_path), "cpu", s, 512)
    t = teacher.tokenizer   # as saved and loaded (AutoTokenizer)
    assert t.is_fast and t.convert_tokens_to_ids("123") == merged_tokenizer().convert_tokens_to_ids("123") == 260
    texts = [("<|im_start|>user 12+3=", "12345 ab"), ("<|im_start|>q", "x45é123"), ("<|im_start|>", "")]
    prompts = [s(p, add_special_tokens=False)["input_ids"] for p, _ in texts]
    responses = [s(r, add_special_tokens=False)["input_ids"] + [s.eos_token_id] for _, r in texts]
    batch = Batch.from_sequences(prompts, responses, group_index=[0, 0, 1])
    old = -torch.rand(batch["response_ids"].shape, generator=torch.Generator().manual_seed(2)) * batch["response_mask"]
    batch = batch.add(old_logprobs=old)
    got, metrics = teacher_logprobs(teacher, batch, budget=24, temperature=0.7, kernels="torch")
    chunks = 0
    for i, (p, r) in enumerate(zip(prompts, responses)):
        a = align(s, t, p, r)
        with torch.no_grad():
            logits = hf_model(torch.tensor([a.prompt + a.response])).logits[0, len(a.prompt) - 1:-1]
        lq = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, torch.tensor(a.response)[:, None])[:, 0]
        for c in range(max(a.student_chunk) + 1):
            ks = [k for k, x in enumerate(a.student_chunk) if x == c]
            js = [j for j, x in enumerate(a.teacher_chunk) if x == c]
            want = old[i, ks] + (lq[js].sum() - old[i, ks].sum()) / len(ks)
            assert (got[i, ks] - want).abs().max().item() <= 1e-5, (i, c)
        chunks += max(a.student_chunk) + 1
        assert got[i, len(r):].abs().max().item() == 0.0 if len(r) < got.shape[1] else True
    assert metrics["distill/student_tokens_per_chunk"] == sum(map(len, responses)) / chunks > 1


def test_teacher_with_another_tokenizer_for_the_full_kl_or_no_weights_is_refused(platform, tmp_path):
    from mrl.train.build import build_teacher

    other = copy.deepcopy(byte_tokenizer())   # (a shared instance: never change it in place)
    other.add_tokens(["<think>"])
    _teacher_dir(tmp_path, tokenizer=other)
    with pytest.raises(UserError, match="distill.model_path: the teacher's tokenizer .* 'full' compares"):
        build_teacher(_spec(tmp_path, "distill.estimator=full"), "cpu", byte_tokenizer(), 512)
    assert build_teacher(_spec(tmp_path), "cpu", byte_tokenizer(), 512).tokenizer is not None   # sampled: re-encoded
    with pytest.raises(UserError, match="holds no weights"):
        build_teacher(_spec("builtin:tiny-qwen2"), "cpu", byte_tokenizer(), 512)


def test_validate_refuses_the_teacher_train_would_refuse(tmp_path):
    """`mrl validate` asks the same `teacher_problems` as `build_teacher`: another tokenizer with the
    full-vocabulary KL is one line naming distill.model_path, before any model is built."""
    import subprocess
    import sys
    from pathlib import Path

    other = copy.deepcopy(byte_tokenizer())
    other.add_tokens(["<think>"])
    _teacher_dir(tmp_path, tokenizer=other)
    proc = subprocess.run([sys.executable, "-m", "mrl", "validate", str(REPO_JOB), "platform.ranks_per_node=1",
                           "parallel.tensor=1", "algorithm.advantage=distill", f"distill.model_path={tmp_path}",
                           "distill.estimator=full"],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert "distill.model_path: the teacher's tokenizer (" in errors[0] and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_teacher_at_its_own_tensor_parallel_size_in_a_tp2_job(tmp_path):
    """One 2-rank launch (`tests/train/scripts/teacher_layout.py`): `distill.parallel.tensor = 1`
    inside `parallel.tensor = 2`, whole on each rank; log-probs equal transformers' (1e-5) with
    the student's tokenizer and with another; the full estimator's rows (the student's half of
    the vocabulary) equal the TP2 teacher's and transformers'."""
    from tests.dist_util import run_torchrun
    from tests.train.merged_tokenizer import merged_tokenizer

    _teacher_dir(tmp_path / "same")
    _teacher_dir(tmp_path / "other", tokenizer=merged_tokenizer())
    proc = run_torchrun("tests/train/scripts/teacher_layout.py", str(tmp_path / "same"), str(tmp_path / "other"),
                        timeout=600)
    for check in ("tp1_teacher_logprobs_equal_transformers", "tp1_teacher_rows_equal_tp2_and_transformers",
                  "tp1_teacher_with_another_tokenizer_equals_transformers"):
        assert f"OK 0 {check}" in proc.stdout and f"OK 1 {check}" in proc.stdout, proc.stdout[-3000:]


def test_the_teachers_tensor_parallel_size_must_divide_the_jobs(tmp_path):
    """What `build_teacher` refuses (`teacher_problems`) `mrl validate` refuses too, before any model."""
    from mrl.config.loader import load
    from mrl.errors import SpecError

    _teacher_dir(tmp_path)
    job = [REPO_JOB, ["algorithm.advantage=distill", f"distill.model_path={tmp_path}"]]
    with pytest.raises(SpecError, match=r"^command line: distill.parallel.tensor: 3 does not divide parallel.tensor = 2 "):
        load(job[0], job[1] + ["distill.parallel.tensor=3"])
    for tp in (1, 2):
        assert load(job[0], job[1] + [f"distill.parallel.tensor={tp}"])[0].distill.parallel.tensor == tp
    moe = tmp_path / "moe"   # a mixture-of-experts teacher: its expert layers use the job's groups
    make_hf_model("qwen3_moe", moe, seed=3, vocab_size=512)
    byte_tokenizer().save_pretrained(moe)
    with pytest.raises(SpecError, match=r"distill.parallel.tensor: a mixture-of-experts teacher takes the job's tensor "):
        load(REPO_JOB, ["algorithm.advantage=distill", f"distill.model_path={moe}", "distill.parallel.tensor=1"])
