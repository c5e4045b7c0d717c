"""Tracking: MLflow params/metrics/artifact/tags in a sqlite store, resume, rank 0 only, plain console."""
import io
import math
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from mrl.config.loader import load
from mrl.tracking.config import TrackingConfig
from mrl.tracking.console import ConsoleProgress
from mrl.tracking.params import flatten
from mrl.tracking.tracker import Tracker, run_dir_of

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    spec, _ = load("jobs/quickstart_cpu.toml", [f"job.output_dir={out}"])
    return spec


def test_flatten_dotted_keys():
    assert flatten({"a": {"b": 1, "c": {"d": True}}, "e": [1, 2], "f": {}, "g": "x"}) == \
        {"a.b": "1", "a.c.d": "true", "e": "[1, 2]", "f": "{}", "g": "x"}


def test_mlflow_run_in_the_run_directory_and_resume(spec):
    stream = io.StringIO()
    tracker = Tracker.from_spec(spec, total_steps=3, rank=0, stream=stream)
    run_dir = run_dir_of(spec)
    store = run_dir.resolve().parent / "mlflow.db"   # one store per output directory, shared by its runs
    assert tracker.mlflow.tracking_uri == spec.tracking.tracking_uri == f"sqlite:///{store}"
    tracker.log_spec(spec)
    tracker.log_metrics({"reward/mean": 0.25, "actor/kl": 0.01, "data/prompts": 256}, step=1)
    tracker.log_metrics({"reward/mean": 0.5, "actor/kl": float("nan")}, step=2)
    run_id = tracker.run_id
    tracker.finish("KILLED")

    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    run = client.get_run(run_id)
    assert run.info.status == "KILLED" and run.info.run_name == "quickstart-cpu"
    p = run.data.params
    digits = f"{REPO / 'jobs/tasks/digits.py'}:score"   # resolved against the job file
    assert p["reward.function"] == digits and p["parallel.tensor"] == "2"
    assert p["data.prompts_per_step"] == "8" and p["tracking.backends"] == '["console", "mlflow"]'
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "reward/mean")] == [(1, 0.25), (2, 0.5)]
    assert math.isnan(client.get_metric_history(run_id, "actor/kl")[-1].value)
    assert len(run.data.tags["mlflow.source.git.commit"]) == 40 and run.data.tags["mrl.env.host"]
    assert "mrl.host" not in run.data.tags   # one host tag
    assert [a.path for a in client.list_artifacts(run_id)] == ["spec.toml"]
    local = client.download_artifacts(run_id, "spec.toml", str(run_dir / "dl"))
    assert f'function = "{digits}"' in open(local).read()
    assert (run_dir.parent / "mlartifacts").is_dir()  # artifacts next to the store, not in the working directory

    # resume: the same run continues; params already logged are not duplicated
    resumed = Tracker.from_spec(spec, total_steps=3, rank=0, stream=stream, resume_run_id=run_id, start_step=2)
    resumed.log_spec(spec)
    resumed.log_metrics({"reward/mean": 0.75}, step=3)
    resumed.finish()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["mrl.resumed_at_step"] == "2"
    assert [m.step for m in client.get_metric_history(run_id, "reward/mean")] == [1, 2, 3]
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_only_rank_zero_tracks(tmp_path):
    stream = io.StringIO()
    t = Tracker(TrackingConfig(), run_dir=tmp_path / "r", total_steps=2, rank=1, stream=stream)
    t.log_params({"a": 1})
    t.log_metrics({"reward/mean": 1.0}, step=1)
    t.finish()
    assert t.run_id is None and stream.getvalue() == "" and not (tmp_path / "r").exists()


def test_console_plain_lines_when_not_a_tty():
    stream = io.StringIO()
    progress = ConsoleProgress(10, start_step=4, file=stream)
    assert not progress.live
    progress.stage("rollout")
    line = progress.step_done(5, {"reward/mean": 0.125, "actor/kl_loss": 0.0031, "actor/pg_approx_kl": 0.5, "other": 3})
    progress.message("checkpoint saved")
    progress.close()
    text = stream.getvalue()
    assert "\x1b[" not in text  # no escape codes in logs
    first, second = text.splitlines()
    assert first == line and first.startswith("step 5/10  reward 0.125  kl_loss 0.0031  ") and " eta 0:" in first
    assert second == "checkpoint saved"
    assert math.isinf(ConsoleProgress(10, start_step=4, file=io.StringIO()).eta_seconds(4))


def test_console_live_bar_on_a_terminal():
    stream = io.StringIO()
    progress = ConsoleProgress(3, file=stream, force_terminal=True)
    assert progress.live
    progress.stage("reward")
    progress.step_done(1, {"reward/mean": 0.5})
    progress.close()
    assert "reward 0.5" in stream.getvalue() and "1/3" in stream.getvalue()


def test_console_only_backend_makes_no_store(tmp_path):
    t = Tracker(TrackingConfig(backends=("console",)), run_dir=tmp_path / "r", total_steps=1, rank=0,
                stream=io.StringIO())
    t.log_metrics({"reward/mean": 1.0}, step=1)
    t.finish()
    assert t.run_id is None and not (tmp_path / "r").exists()


def test_console_labels_say_which_kl_and_show_validation_reward():
    stream = io.StringIO()
    progress = ConsoleProgress(4, file=stream)
    approx = progress.step_done(1, {"reward/mean": 0.5, "actor/pg_approx_kl": 0.02})
    reward_kl = progress.step_done(2, {"reward/mean": 0.5, "kl/reward_kl": 0.03, "actor/pg_approx_kl": 0.02,
                                       "val/reward_mean": 0.75})
    assert "approx_kl 0.02" in approx and " kl " not in approx and "val_reward" not in approx
    assert "reward_kl 0.03" in reward_kl and "approx_kl" not in reward_kl and "val_reward 0.75" in reward_kl


def test_log_every_steps_sets_the_console_cadence(tmp_path):
    spec, _ = load(REPO / "jobs/quickstart_cpu.toml", [f"job.output_dir={tmp_path}", "trainer.log_every_steps=2",
                                                       "tracking.backends=console"])
    stream = io.StringIO()
    tracker = Tracker.from_spec(spec, total_steps=5, rank=0, stream=stream)
    for step in range(1, 6):
        tracker.log_metrics({"reward/mean": step / 10}, step)
    tracker.finish()
    steps = [line.split()[1] for line in stream.getvalue().splitlines() if line.startswith("step ")]
    assert steps == ["2/5", "4/5", "5/5"]   # every 2nd step, and the last


def test_profile_steps_write_a_trace_only_for_listed_steps(tmp_path):
    import torch

    from mrl.tracking.profile import profile_step, trace_path

    for step in (1, 2, 3):
        with profile_step((2,), step, tmp_path, rank=1):
            torch.ones(8, 8) @ torch.ones(8, 8)
    assert trace_path(tmp_path, 2, 1).is_file() and '"traceEvents"' in trace_path(tmp_path, 2, 1).read_text()
    assert not trace_path(tmp_path, 1, 1).exists() and not trace_path(tmp_path, 3, 1).exists()


def test_start_prints_the_run_directory_and_the_mlflow_ui_command(spec):
    stream = io.StringIO()
    tracker = Tracker.from_spec(spec, total_steps=1, rank=0, stream=stream)
    tracker.finish()
    first, second = stream.getvalue().splitlines()[:2]
    assert first == f"run directory: {run_dir_of(spec).resolve()}"
    assert second.startswith(f"metrics: mlflow ui --backend-store-uri {spec.tracking.tracking_uri}   (run ")


def test_mlflow_store_creation_is_quiet(tmp_path, capfd):
    import logging

    from mrl.platform.quiet import quiet_known_warnings

    quiet_known_warnings()
    logging.basicConfig(level=logging.INFO)   # even with INFO on for everything else
    t = Tracker(TrackingConfig(backends=("mlflow",)), run_dir=tmp_path / "r", total_steps=1, rank=0,
                stream=io.StringIO())
    for step in (1, 2):   # the second append downloads the table first
        t.log_samples("train", {"step": [step], "response": ["42"]})
    t.finish()
    out, err = capfd.readouterr()
    assert "Creating initial MLflow database tables" not in out + err and "Updating database tables" not in out + err
    assert "Downloading artifacts" not in out + err


def test_throughput_is_the_whole_jobs_tokens_over_the_slowest_rank():
    from mrl.tracking.perf import throughput

    # means over 4 DP ranks of per-rank token counts; stage times already maxima over ranks
    m = {"tokens/rollout_response": 1000.0, "time/rollout": 2.0, "tokens/actor_update": 3000.0, "time/actor_update": 0.5}
    assert throughput(m, dp=4) == {"throughput/rollout_tokens_per_s": 2000.0, "throughput/train_tokens_per_s": 24000.0}
    assert throughput({"tokens/rollout_response": 5.0}, dp=1) == {}


def test_stage_timer_reports_peak_cuda_memory_per_stage(monkeypatch):
    """On CUDA each stage reports the allocator's peak during it (faked here: no GPU in this tier)."""
    from mrl.train import timer

    class FakeCuda:
        peak = 0

        def reset_peak_memory_stats(self):
            FakeCuda.peak = 0

        def max_memory_allocated(self):
            return FakeCuda.peak

    monkeypatch.setattr(timer, "_cuda", lambda: FakeCuda())
    t = timer.StageTimer()
    with t("rollout"):
        FakeCuda.peak = 3 * 2**30
    with t("actor_update"):
        FakeCuda.peak = 2**29
    m = t.metrics()
    assert m["memory/rollout_peak_gib"] == 3.0 and m["memory/actor_update_peak_gib"] == 0.5


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-llama", "tiny-qwen3-moe"])
def test_model_params_match_transformers(preset):
    """The parameter count behind MFU equals the Hugging Face model's (all experts for `active=False`)."""
    import dataclasses

    from transformers import AutoConfig, AutoModelForCausalLM

    from mrl.models.facts import BUILTIN_PRESETS
    from mrl.tracking.perf import model_params

    cfg = AutoConfig.for_model(**BUILTIN_PRESETS[preset])
    model = AutoModelForCausalLM.from_config(cfg)
    hf = cfg.to_dict()
    assert model_params(hf, active=False) == sum(p.numel() for p in model.parameters())
    if hf.get("num_local_experts") or hf.get("num_experts"):
        per_expert = 3 * hf["hidden_size"] * hf["moe_intermediate_size"] * hf["num_hidden_layers"]
        assert model_params(hf) == model_params(hf, active=False) - 2 * per_expert   # 2 of 4 experts active


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3", "kimi_k2", "glm4_moe", "gpt_oss", "gemma3_text",
                                  "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"])
def test_model_params_of_shared_experts_and_mla_match_transformers(arch):
    """Shared experts (Qwen2-MoE's gated one, DeepSeek's, GLM-4.5's), the dense first layers,
    MLA, GLM-4.5's QKV bias and QK-norm, gpt-oss' biases and sinks, Gemma 3's four norms a layer,
    the hybrids' Gated DeltaNet layers and gated attention (q_proj twice as wide)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mrl.models.facts import canonical_config
    from mrl.tracking.perf import model_params
    from tests.weights.archs import _COMMON, ARCHS

    for extra in ({}, {"q_lora_rank": None} if arch == "deepseek_v3" else {}):
        cfg = AutoConfig.for_model(**canonical_config({**_COMMON, **ARCHS[arch], **extra}))
        hf = cfg.to_dict()
        assert model_params(hf, active=False) == sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
        if arch in ("gemma3_text", "qwen3_5_text"):
            continue
        experts = hf.get("n_routed_experts") or hf.get("num_experts") or hf["num_local_experts"]
        moe_layers = hf["num_hidden_layers"] - (hf.get("first_k_dense_replace") or 0)
        inter = hf.get("moe_intermediate_size") or hf["intermediate_size"]
        per_expert = 3 * hf["hidden_size"] * inter + (2 * inter + hf["hidden_size"] if arch == "gpt_oss" else 0)
        idle = (experts - hf["num_experts_per_tok"]) * per_expert * moe_layers
        assert model_params(hf) == model_params(hf, active=False) - idle


def test_deltanet_flops_per_token_by_hand():
    """tiny-qwen3-next: one DeltaNet layer of 4 value heads, d_k = d_v = 32: 4 x 7 x 32 x 32 forward
    FLOPs a token (decay, recall, update, read); none for a model without DeltaNet layers."""
    from mrl.models.facts import find_hf_config
    from mrl.tracking.perf import deltanet_flops_per_token

    assert deltanet_flops_per_token(find_hf_config("builtin:tiny-qwen3-next")[0]) == 4 * 7 * 32 * 32
    assert deltanet_flops_per_token(find_hf_config("builtin:tiny-qwen3-moe")[0]) == 0


def test_actor_mfu_on_a_known_device():
    from mrl.tracking.perf import actor_mfu, model_params

    hf = {"hidden_size": 4, "num_hidden_layers": 1, "vocab_size": 8, "num_attention_heads": 1, "intermediate_size": 8,
          "tie_word_embeddings": True}
    n = model_params(hf)
    got = actor_mfu({"throughput/train_tokens_per_s": 1e12}, hf, world=2, device_name="NVIDIA H100 80GB HBM3")
    assert got == {"throughput/actor_mfu": 6 * n * 1e12 / (2 * 989e12)}
    assert actor_mfu({"throughput/train_tokens_per_s": 1e12}, hf, world=2, device_name="cpu") == {}


def _tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_tensorboard_backend_writes_real_event_files_and_a_resume_replaces_rerun_steps(tmp_path):
    run = tmp_path / "r"
    stream = io.StringIO()
    t = Tracker(TrackingConfig(backends=("tensorboard",)), run_dir=run, total_steps=3, rank=0, stream=stream)
    for step in (1, 2, 3):
        t.log_metrics({"reward/mean": float(step), "actor/loss": -step / 10}, step)
    t.finish()
    assert f"tensorboard --logdir {(run / 'tensorboard').resolve()}" in stream.getvalue()
    assert _tensorboard_scalars(run / "tensorboard")["reward/mean"] == {1: 1.0, 2: 2.0, 3: 3.0}
    # resumed from a checkpoint at step 1: steps 2 and 3 run again with new values
    t = Tracker(TrackingConfig(backends=("tensorboard",)), run_dir=run, total_steps=3, rank=0, start_step=1,
                stream=io.StringIO())
    for step in (2, 3):
        t.log_metrics({"reward/mean": 10.0 * step}, step)
    t.finish()
    assert _tensorboard_scalars(run / "tensorboard")["reward/mean"] == {1: 1.0, 2: 20.0, 3: 30.0}
    # other ranks write nothing
    Tracker(TrackingConfig(backends=("tensorboard",)), run_dir=tmp_path / "other", total_steps=1, rank=1).finish()
    assert not (tmp_path / "other").exists()
