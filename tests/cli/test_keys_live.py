"""Every key a job spec accepts is acted on: removed keys say why, derived defaults are filled once,
and each of the keys that once validated and did nothing now changes what runs."""
from __future__ import annotations

import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mrl.config.job import JobSpec
from mrl.config.loader import load
from mrl.errors import SpecError, UserError
from mrl.schema.section import fields_of, section_of

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "jobs/quickstart_cpu.toml"

# Keys the trainer never reads by attribute, and why that is still acting on them.
READ_ELSEWHERE: dict[str, str] = {}


def _leaves(cls, prefix=""):
    for name, f in fields_of(cls).items():
        sub = section_of(f.type)
        if sub is not None:
            yield from _leaves(sub, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def test_every_declared_key_is_read_outside_the_config_package():
    """A key that only the config package mentions validates and then does nothing."""
    sources = [p for p in (REPO / "mrl").rglob("*.py") if "config" not in p.relative_to(REPO / "mrl").parts
               and p.name != "config.py"]
    text = "\n".join(p.read_text() for p in sources)
    unread = [key for key in _leaves(JobSpec) if key not in READ_ELSEWHERE
              and not re.search(rf"\.{key.rsplit('.', 1)[-1]}\b|['\"]{key.rsplit('.', 1)[-1]}['\"]", text)]
    assert not unread, f"declared but never read: {unread}"


@pytest.mark.parametrize("key,verl", [
    ("actor.offload_params=true", "actor_rollout_ref.actor.megatron.param_offload=true"),
    ("ref.offload_params=true", "actor_rollout_ref.ref.megatron.param_offload=true"),
    ("critic.offload_params=true", None),
    ("rollout.skip_tokenizer_init=true", "actor_rollout_ref.rollout.skip_tokenizer_init=true"),
    ("trainer.balance_batch=true", "trainer.balance_batch=true"),
])
def test_removed_keys_say_why_and_what_to_use(key, verl):
    for item in filter(None, (key, verl)):
        with pytest.raises(SpecError) as e:
            load(QUICKSTART, [item])
        name = item.partition("=")[0]
        (line,) = e.value.problems
        assert f"{name}: not an mrl key: " in line and "remove it" in line, line


def test_a_removed_key_in_a_job_file_names_its_line(tmp_path):
    job = tmp_path / "old.toml"
    job.write_text(f'extends = "{QUICKSTART}"\n[ref]\noffload_params = true\n')
    with pytest.raises(SpecError) as e:
        load(job)
    assert e.value.problems == [f"{job}:3: ref.offload_params: not an mrl key: parameter offload is not implemented: "
                                "trainer parameters stay on the device (the rollout engine frees its own memory with "
                                "rollout.sleep_level; actor.optim.offload moves optimizer state to the host); remove it"]


# ---- defaults resolved once ----------------------------------------------------------------------

def test_resolve_fills_every_derived_default():
    spec, _ = load(QUICKSTART, ["algorithm.loss_aggregation=seq-mean-token-sum-norm", "algorithm.kl_loss.enable=true"])
    assert spec.algorithm.loss_norm == float(spec.rollout.max_response_tokens) == 8.0
    assert spec.algorithm.dynamic_sampling.generation_batch_prompts == spec.data.prompts_per_step
    assert spec.actor.logprob_micro_batch_tokens == spec.actor.micro_batch_tokens
    assert spec.ref.enable and spec.ref.model_path == spec.model.path and spec.ref.micro_batch_tokens == 512
    assert spec.model.tokenizer == spec.model.path
    assert spec.rollout.seed == spec.data.seed == spec.job.seed and spec.rollout.weight_sync.dtype == "float32"
    assert Path(spec.job.output_dir).is_absolute()
    assert spec.checkpoint.dir == str(Path(spec.job.output_dir) / "quickstart-cpu" / "checkpoints")
    assert spec.tracking.tracking_uri == f"sqlite:///{Path(spec.job.output_dir) / 'mlflow.db'}"


def test_show_prints_every_resolved_default(cli):
    rc, out, err = cli("show", QUICKSTART, "algorithm.loss_aggregation=seq-mean-token-sum-norm")
    assert rc == 0, err
    for line in ("loss_norm = 8.0", "generation_batch_prompts = 8", "logprob_micro_batch_tokens = 512",
                 'tokenizer = "builtin:tiny-qwen2"', "tracking_uri = \"sqlite:///"):
        assert line in out, line


def test_policy_loss_does_not_depend_on_the_padded_batch_width():
    """seq-mean-token-sum-norm divides by the resolved loss_norm, not by the width of the batch
    (which changes from step to step and rank to rank)."""
    from mrl.algos import losses
    from mrl.train.step import policy_objective

    spec, _ = load(QUICKSTART, ["algorithm.loss_aggregation=seq-mean-token-sum-norm"])
    objective = policy_objective(SimpleNamespace(spec=spec, hf={"vocab_size": 32}))   # a Run's fields
    assert objective.norm == 8.0 and objective.aggregation == "seq-mean-token-sum-norm"
    per_token = torch.tensor([[0.5, -1.0, 0.25], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    values = []
    for width in (4, 12, 40):
        padded = torch.zeros(2, width)
        padded[:, :3] = per_token
        m = torch.zeros(2, width, dtype=torch.long)
        m[:, :3] = mask
        values.append(float(losses.aggregate(padded, m, objective.aggregation, objective.norm)))
    assert values == [pytest.approx((0.5 - 1.0 + 0.25 + 2.0) / (2 * 8.0))] * 3


# ---- rollout.generate_timeout_s ------------------------------------------------------------------

class _SlowEngine:
    def __init__(self, seconds):
        self.seconds = seconds

    def generate(self, prompt_ids, sampling):
        time.sleep(self.seconds)
        return ["done"] * len(prompt_ids)


def _components(spec, engine):
    """(run, generation) fakes: one leader rank, no process group."""
    from mrl.train.parts import Generation

    return SimpleNamespace(spec=spec, separate=False), Generation(generator=engine)


def test_a_generate_call_past_rollout_generate_timeout_s_is_an_error():
    from mrl.rollout.types import Sampling
    from mrl.train.rollout import generate

    spec, _ = load(QUICKSTART, ["rollout.generate_timeout_s=0.3"])
    start = time.monotonic()
    with pytest.raises(UserError, match=r"ran longer than rollout.generate_timeout_s = 0.3 s"):
        generate(*_components(spec, _SlowEngine(30)), [[1, 2]], Sampling(n=2))
    assert time.monotonic() - start < 5
    assert generate(*_components(spec, _SlowEngine(0)), [[1], [2]], Sampling(n=2)) == ["done", "done"]


def test_generate_errors_propagate_from_the_timed_call():
    from mrl.rollout.types import Sampling
    from mrl.train.rollout import generate

    class Broken:
        def generate(self, prompt_ids, sampling):
            raise ValueError("engine broke")

    spec, _ = load(QUICKSTART)
    with pytest.raises(ValueError, match="engine broke"):
        generate(*_components(spec, Broken()), [[1]], Sampling())


# ---- algorithm.dynamic_sampling.metric -----------------------------------------------------------

def _result(**kw):
    from mrl.reward.compose import RewardResult

    base = dict(scores=[0.5, 0.5, 1.0, 0.0], valid=[True] * 4, source_scores={"correct": [1.0, 0.0, 1.0, 1.0]},
                metrics={"correct/acc": [1.0, 0.0, float("nan"), 0.0]}, errors=[], stats={})
    return RewardResult(**{**base, **kw})


def test_dynamic_sampling_metric_picks_the_reward_output_that_decides_equality():
    from mrl.algos.dapo import keep_groups
    from mrl.train.scoring import filter_values

    r = _result()
    assert filter_values(r, "score") == [0.5, 0.5, 1.0, 0.0]
    assert filter_values(r, "correct") == [1.0, 0.0, 1.0, 1.0]
    assert filter_values(r, "acc") == filter_values(r, "correct/acc") == [1.0, 0.0, 0.0, 0.0]  # failed -> 0
    groups = torch.tensor([0, 0, 1, 1])
    # the same responses: "score" drops group 0, "acc" drops group 1
    assert keep_groups(torch.tensor(filter_values(r, "score")), groups).tolist() == [False, False, True, True]
    assert keep_groups(torch.tensor(filter_values(r, "acc")), groups).tolist() == [True, True, False, False]
    with pytest.raises(UserError, match=r"metric = 'accuracy': no such reward output; the rewards return: score, "
                                        r"correct, correct/acc"):
        filter_values(r, "accuracy")


def test_generation_batch_prompts_only_with_dynamic_sampling():
    with pytest.raises(SpecError, match="only dynamic sampling and partial rollouts generate more prompts"):
        load(QUICKSTART, ["algorithm.dynamic_sampling.generation_batch_prompts=16"])
    with pytest.raises(SpecError, match="do not split evenly over data-parallel size 2"):
        load(QUICKSTART, ["parallel.tensor=1", "algorithm.dynamic_sampling.enable=true",
                          "algorithm.dynamic_sampling.generation_batch_prompts=9"])
    spec, _ = load(QUICKSTART, ["algorithm.dynamic_sampling.enable=true",
                                "algorithm.dynamic_sampling.generation_batch_prompts=16"])
    assert spec.algorithm.dynamic_sampling.generation_batch_prompts == 16


# ---- end to end: the keys change what a run does --------------------------------------------------

def _train(out: Path, *overrides: str, timeout: float = 600):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "mrl", "train", str(QUICKSTART), "platform.ranks_per_node=1",
                           "parallel.tensor=1", f"job.output_dir={out}", "job.name=run", *overrides],
                          capture_output=True, text=True, timeout=timeout, cwd=out,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})


@pytest.mark.slow
def test_dapo_generation_rounds_profile_and_hf_export_in_one_run(tmp_path):
    from mlflow.tracking import MlflowClient

    proc = _train(tmp_path, "trainer.total_steps=2", "checkpoint.every_steps=0", "tracking.backends=mlflow",
                  "algorithm.dynamic_sampling.enable=true", "algorithm.dynamic_sampling.metric=score",
                  "algorithm.dynamic_sampling.generation_batch_prompts=16", "trainer.profile_steps=2",
                  "checkpoint.save_hf_at_end=true", "trainer.val_every_steps=2", "data.val_prompts=4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "Downloading artifacts" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("mrl").experiment_id])
    rounds = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "rollout/generation_rounds")}
    generated = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "rollout/responses_generated")}
    for step in (1, 2):   # every round generates 16 prompts x 8 responses, not prompts_per_step 8 x 8
        assert generated[step] == rounds[step] * 16 * 8
    assert (tmp_path / "run/profile/step_2/rank_0.json").is_file()
    assert not (tmp_path / "run/profile/step_1").exists()
    hf = tmp_path / "run/hf/step_2"
    assert (hf / "config.json").is_file() and list(hf.glob("*.safetensors")), sorted(hf.iterdir())
    assert f"Hugging Face export: {hf}" in proc.stdout + proc.stderr

    # what the run recorded: sample tables, throughput, stage timings, the environment
    import json

    import torch

    run = client.get_run(run.info.run_id)
    metrics = run.data.metrics
    for key in ("throughput/rollout_tokens_per_s", "throughput/train_tokens_per_s", "time/reward_scoring",
                "time/validation", "time/checkpoint", "tokens/rollout_response", "tokens/actor_update"):
        assert metrics.get(key, 0) > 0, (key, sorted(metrics))
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "samples")}
    assert artifacts == {"samples/train.json", "samples/validation.json"}, artifacts
    table = json.load(open(client.download_artifacts(run.info.run_id, "samples/train.json", str(tmp_path))))
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert len(rows) == 16 and {r["step"] for r in rows} == {2} and all(0 <= r["score"] <= 1 for r in rows)
    assert rows[0]["prompt"].startswith("Pick a number between") and rows[0]["response_tokens"] <= 8
    tags = run.data.tags
    assert tags["mrl.env.torch"] == torch.__version__ and tags["mrl.env.megatron_core"].startswith("0.")
    assert tags["mrl.env.vllm"] and tags["mrl.env.host"] and len(tags["mlflow.source.git.commit"]) == 40


@pytest.mark.slow
def test_dynamic_sampling_metric_decides_what_is_kept(tmp_path):
    """`all_digits` is 0 for every response of a random policy: every group is all-equal under it
    (while `score` varies), so nothing is kept and the run stops with one line."""
    proc = _train(tmp_path, "trainer.total_steps=1", "tracking.backends=[]", "algorithm.dynamic_sampling.enable=true",
                  "algorithm.dynamic_sampling.metric=all_digits", "algorithm.dynamic_sampling.max_generation_batches=1",
                  "algorithm.dynamic_sampling.on_exhausted=proceed")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: step 1: no prompt kept after 1 generation rounds" in proc.stderr and "Traceback" not in proc.stderr


def test_dynamic_sampling_metric_is_checked_against_builtin_outputs():
    dapo = REPO / "jobs/dapo_32b.toml"
    spec, _ = load(dapo)
    assert spec.algorithm.dynamic_sampling.metric == "acc"   # the published configuration: math's correctness
    with pytest.raises(SpecError, match=r"metric: 'accuracy' is not an output of the job's rewards \(they give: "
                                        r"score, math, math/acc, math/parsed, acc, parsed\)"):
        load(dapo, ["algorithm.dynamic_sampling.metric=accuracy"])
    from mrl.reward import builtins as b

    assert b.math("", "\\boxed{2}", "2", {})["acc"] == 1.0 and b.gsm8k("", "#### 3", "2", {})["acc"] == 0.0
