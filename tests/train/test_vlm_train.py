"""The VLM quickstart (`jobs/quickstart_vlm_cpu.toml`, tiny Qwen2.5-VL, images drawn at run time)
as a CI test on one rank, made small: 4 prompts x 4 responses a step, partial rollouts (groups
still generating when a step's batch is full are carried over, through the checkpoint too, and
continue with their prompt's images), and a reward with a spread from step 1
(`vlm_first_byte.py`: the colour task scores ~0 for the first steps, which would train nothing).
The learning rate is constant: the first leg stops through `trainer.total_steps = 2`, and the
job's cosine schedule would decay over that leg's 2 steps instead of 3.

fp32: a run stopped at step 2 and resumed equals the uninterrupted 3-step run in every non-time
metric (a step that trains only groups scored earlier logs no reward keys, in both). bf16: the
same 3 steps train. Both: the step-1 audit (rollout log-probs with images vs the trainer's) is
within 1e-4 (in bf16 both sides' CPU attention computes in float32 and rounds once:
mrl/models/flash_cpu.py, mrl/rollout/hf_attention.py; 3.9e-3 with the engine's in bf16). The four runs share one process (`run_jobs.py`),
with two more: the tiny multimodal Gemma 3's 5 GRPO steps in fp32 and bf16 (`check_gemma3`)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.train.test_train import ONE_RANK, run_jobs
from tests.train.test_train_bf16 import _history

pytestmark = pytest.mark.slow

SMALL = (f"{ONE_RANK} reward.workers=1 data.prompts_per_step=4 rollout.responses_per_prompt=4 actor.mini_batch_prompts=4 "
         "rollout.partial_rollout_tokens=2 rollout.max_staleness=1 algorithm.dynamic_sampling.generation_batch_prompts=6 "
         "checkpoint.every_steps=2 tracking.backends=[\"mlflow\"] job.name=run actor.schedule.decay=constant "
         f"reward.function={Path(__file__).parent / 'vlm_first_byte.py'}:score")


def test_vlm_quickstart_resumes_exactly_in_fp32_and_trains_in_bf16(tmp_path):
    fp32, bf16 = f"{SMALL} model.dtype=float32", f"{SMALL} model.dtype=bfloat16"
    results = run_jobs("jobs/quickstart_vlm_cpu.toml", tmp_path,
                       f"{fp32} job.output_dir={tmp_path / 'whole'} trainer.total_steps=3",
                       f"{fp32} job.output_dir={tmp_path / 'resumed'} trainer.total_steps=2",
                       f"{fp32} job.output_dir={tmp_path / 'resumed'} trainer.total_steps=3",
                       f"{bf16} job.output_dir={tmp_path / 'bf16'} trainer.total_steps=3",
                       *(f"{GEMMA3} model.dtype={d} job.output_dir={tmp_path / ('gemma3-' + d)}" for d in DTYPES),
                       timeout=900)
    whole, again = _history(tmp_path / "whole"), _history(tmp_path / "resumed")
    keys = [k for k in whole if not k.startswith(("time/", "throughput/", "memory/", "weight_sync/"))]
    assert [k for k in keys if again.get(k) != whole[k]] == [], [(k, whole[k], again.get(k)) for k in keys
                                                                 if again.get(k) != whole[k]]
    assert len(keys) > 30 and sorted(again["actor/updated"]) == [1, 2, 3]   # steps 1-3 in both runs
    # partial rollouts: later steps trained responses that earlier steps began
    assert sum(whole["rollout/partial_tokens_carried"].values()) > 0, whole["rollout/partial_tokens_carried"]
    bf = _history(tmp_path / "bf16")
    for name, h in (("float32", whole), ("bfloat16", bf)):
        assert h["rollout/logprob_abs_diff_max"][1] <= 1e-4, (name, h["rollout/logprob_abs_diff_max"])
        assert all(v > 0 for v in h["actor/grad_norm"].values()), (name, h["actor/grad_norm"])   # it trained
        print(name, {k: [round(v, 7) for _, v in sorted(h[k].items())]
                     for k in ("reward/mean", "rollout/logprob_abs_diff_max", "actor/grad_norm")})
    assert all(r["actor/updated"] == 1 for r in results[:4])
    check_gemma3(tmp_path)


#: the tiny multimodal Gemma 3 (`builtin:tiny-gemma3-vl`: SigLIP tower, images attending both ways)
#: on the same colour images, 5 GRPO steps in the same process (`run_jobs`)
GEMMA3 = (f"{ONE_RANK} reward.workers=1 model.path=builtin:tiny-gemma3-vl trainer.total_steps=5 checkpoint.every_steps=0 "
          "data.prompts_per_step=2 rollout.responses_per_prompt=4 actor.mini_batch_prompts=1 tracking.backends=[\"mlflow\"] "
          f"job.name=run reward.function={Path(__file__).parent / 'vlm_first_byte.py'}:score")
DTYPES = ("float32", "bfloat16")


def check_gemma3(tmp_path: Path) -> None:
    """The multimodal Gemma 3's runs: 5 steps, each logged; the step-1 audit (the hf engine's
    log-probs with images against the trainer's) within 1e-4 in float32, the bf16 figure printed
    and bounded as the text presets' (test_train's `BF16_AUDIT_MAX`); it trained."""
    from tests.train.test_train import BF16_AUDIT_MAX

    for dtype in DTYPES:
        h = _history(tmp_path / f"gemma3-{dtype}")
        assert sorted(h["reward/mean"]) == [1, 2, 3, 4, 5], dtype
        audit = h["rollout/logprob_abs_diff_max"][1]
        print(f"tiny-gemma3-vl {dtype}: step-1 audit max {audit:.2e} mean {h['rollout/logprob_abs_diff_mean'][1]:.2e}")
        assert audit <= (1e-4 if dtype == "float32" else BF16_AUDIT_MAX), (dtype, audit)
        assert sum(v > 0 for v in h["actor/grad_norm"].values()) >= 3, (dtype, h["actor/grad_norm"])

