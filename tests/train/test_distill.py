"""On-policy distillation (`algorithm.advantage = "distill"`, `[distill]`) end to end through
`mrl train` on CPU: a larger tiny teacher is trained on the quickstart task in the test, then the
builtin student learns from it; a stopped distillation run resumes exactly."""
from __future__ import annotations

import copy

import json
import subprocess
import sys

import pytest
import torch

from tests.dist_util import REPO
from tests.train.resume import assert_resumed_exactly, whole_and_resumed
from tests.train.test_train import ONE_RANK, history, run_jobs

pytestmark = pytest.mark.slow

TEACHER = {"model_type": "qwen2", "hidden_size": 192, "intermediate_size": 384, "num_hidden_layers": 3,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 1024,
           "tie_word_embeddings": True}   # the student, builtin:tiny-qwen2: hidden 128, 2 layers
BASE = f"{ONE_RANK} tracking.backends=[\"mlflow\"] checkpoint.every_steps=0"


def _last5(rewards: dict[int, float]) -> float:
    return sum(rewards[s] for s in sorted(rewards)[-5:]) / 5


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """(HF directory, its last-5-step mean reward): random init from transformers with the
    student's byte tokenizer, 20 GRPO steps of the quickstart, merged."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mrl.models.tokenizer import byte_tokenizer

    root = tmp_path_factory.mktemp("teacher")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TEACHER), dtype=torch.float32).save_pretrained(root / "init")
    byte_tokenizer().save_pretrained(root / "init")
    run_jobs("jobs/quickstart_cpu.toml", root, f"{BASE} trainer.total_steps=20 model.path={root / 'init'}")
    reward = _last5(history(root / "run0")["reward/mean"])
    subprocess.run([sys.executable, "-m", "mrl", "merge", str(root / "run0"), str(root / "hf")], cwd=REPO, check=True,
                   capture_output=True, timeout=600)
    assert json.loads((root / "hf/config.json").read_text())["num_hidden_layers"] == 3
    return root / "hf", reward


def test_distillation_moves_the_student_reward_to_the_teachers(tmp_path, teacher):
    path, teacher_reward = teacher
    run_jobs("jobs/quickstart_cpu.toml", tmp_path, f"{BASE} trainer.total_steps=20 algorithm.advantage=distill "
             f"distill.model_path={path} rollout.responses_per_prompt=4")
    h = history(tmp_path / "run0")
    r, kl = h["reward/mean"], h["distill/reverse_kl"]
    print(f"teacher {teacher_reward:.3f}; student {r[1]:.3f} -> {_last5(r):.3f}; reverse KL {kl[1]:.2f} -> {kl[20]:.2f}")
    assert teacher_reward >= 0.8 and r[1] <= 0.2
    assert _last5(r) >= r[1] + 0.75 * (teacher_reward - r[1])   # most of the way to the teacher
    assert kl[20] < kl[1] / 4   # the student's tokens move to where the teacher puts its mass


def test_distillation_with_a_task_reward_resumes_exactly(tmp_path, teacher):
    """One launch: fp32 with the sampled estimator; bf16 (student and teacher) with the
    full-vocabulary KL; fp32 with the teacher's tokenizer made another (one added token), read
    through the re-encoding path (`mrl.train.retokenize`). The untrained student's responses
    are mostly bytes that are not UTF-8 text: decoded to U+FFFD, they merge into chunks of
    several tokens (docs/algorithms.md), so the third run learns otherwise than the first but
    generates the same first step."""
    import shutil

    from mrl.models.tokenizer import byte_tokenizer

    path, _ = teacher
    other = tmp_path / "other_tokenizer"
    shutil.copytree(path, other)
    tokenizer = copy.deepcopy(byte_tokenizer())   # byte_tokenizer() is one cached instance: never change it in place
    tokenizer.add_tokens(["<think>"])
    tokenizer.save_pretrained(other)
    base = (f"{ONE_RANK} tracking.backends=[\"mlflow\"] checkpoint.every_steps=2 algorithm.advantage=distill "
            f"distill.task_weight=0.5 rollout.responses_per_prompt=4")
    variants = {"distill/reverse_kl": f"distill.model_path={path}",
                "actor/distill_kl": f"distill.model_path={path} model.dtype=bfloat16 distill.estimator=full",
                "distill/student_tokens_per_chunk": f"distill.model_path={other}"}
    runs = whole_and_resumed("jobs/quickstart_cpu.toml", tmp_path, *(f"{base} {v}" for v in variants.values()))
    for metric, (whole, again) in zip(variants, runs):
        assert metric in assert_resumed_exactly(whole, again), metric
    shared, retokenized = runs[0][0], runs[2][0]
    assert retokenized["reward/mean"][1] == shared["reward/mean"][1]
    assert all(v >= 1 for v in retokenized["distill/student_tokens_per_chunk"].values())


def test_full_vocabulary_reverse_kl_distils_too(tmp_path, teacher):
    """`distill.estimator = "full"`: the reverse KL over the whole vocabulary as the loss, no
    advantage; the student reaches the teacher's reward and the exact KL falls."""
    path, teacher_reward = teacher
    run_jobs("jobs/quickstart_cpu.toml", tmp_path, f"{BASE} trainer.total_steps=20 algorithm.advantage=distill "
             f"distill.model_path={path} distill.estimator=full rollout.responses_per_prompt=4")
    h = history(tmp_path / "run0")
    r, kl = h["reward/mean"], h["actor/distill_kl"]
    print(f"full: teacher {teacher_reward:.3f}; student {r[1]:.3f} -> {_last5(r):.3f}; KL {kl[1]:.2f} -> {kl[20]:.3f}")
    assert r[1] <= 0.2 and _last5(r) >= r[1] + 0.75 * (teacher_reward - r[1])
    assert kl[20] < kl[1] / 4 and "distill/reverse_kl" not in h and h["actor/pg_loss"][1] == 0


def test_full_vocabulary_distillation_at_tp2(tmp_path, teacher):
    """The student split over two tensor-parallel ranks, the teacher whole on each
    (`distill.parallel.tensor = 1`, giving each rank the student's half of its vocabulary), in
    bf16 (fp32 at this layout: tests/train/test_teacher.py): the KL is reduced over the
    student's vocabulary shards."""
    from tests.dist_util import run_torchrun

    path, _ = teacher
    run_torchrun("-m mrl train", "jobs/quickstart_cpu.toml", "algorithm.advantage=distill", f"distill.model_path={path}",
                 "distill.estimator=full", "distill.parallel.tensor=1", "model.dtype=bfloat16", "rollout.responses_per_prompt=4",
                 "trainer.total_steps=2",
                 f"job.output_dir={tmp_path}", "tracking.backends=[\"mlflow\"]", "checkpoint.every_steps=0", timeout=600)
    h = history(tmp_path / "quickstart-cpu")
    assert h["actor/distill_kl"][1] > 1 and h["actor/updated"][2] == 1
