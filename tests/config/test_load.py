"""Loading, extends, overrides, round trip of `mrl show`, and the CLI's exit codes."""
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from mrl.config.job import JobSpec
from mrl.config.loader import load
from mrl.config.suggest import VERL_TO_MRL
from mrl.schema.dump import to_toml
from mrl.schema.section import all_keys, fields_of, optional_inner, section_of

REPO = Path(__file__).resolve().parents[2]
JOBS = sorted((REPO / "jobs").glob("*.toml"))


def test_every_shipped_job_validates(cli, monkeypatch):
    monkeypatch.chdir(REPO)
    rc, out, err = cli("validate", *JOBS)
    assert rc == 0, err
    assert out.count("ok: ") == len(JOBS) >= 5


@pytest.mark.parametrize("job", JOBS, ids=[j.stem for j in JOBS])
def test_show_round_trips(job, tmp_path, cli, monkeypatch):
    monkeypatch.chdir(REPO)
    rc, shown, err = cli("show", job)
    assert rc == 0, err
    again = tmp_path / "shown.toml"
    again.write_text(shown)
    spec1, _ = load(job)
    spec2, _ = load(again)
    assert spec1 == spec2
    assert to_toml(spec2) == to_toml(spec1)


def test_dapo_job_is_the_published_configuration(monkeypatch):
    monkeypatch.chdir(REPO)
    spec, _ = load(REPO / "jobs/dapo_32b.toml")
    alg = spec.algorithm
    assert (spec.data.prompts_per_step, spec.rollout.responses_per_prompt) == (512, 16)
    assert alg.dynamic_sampling.generation_batch_prompts == 1536 and alg.dynamic_sampling.max_generation_batches == 10
    assert spec.actor.mini_batch_prompts == 32
    assert (spec.actor.optim.lr, spec.actor.schedule.warmup_steps, spec.actor.optim.weight_decay) == (1e-6, 10, 0.1)
    assert spec.actor.optim.grad_clip == 1.0
    assert (alg.clip_low, alg.clip_high, alg.dual_clip, alg.loss_aggregation) == (0.2, 0.28, 10.0, "token-mean")
    assert not alg.kl_loss.enable and not alg.kl_reward.enable and not spec.ref.enable
    assert spec.rollout.max_response_tokens == 20480 and alg.overlong.buffer_tokens == 4096
    assert alg.overlong.penalty_factor == 1.0 and spec.rollout.temperature == 1.0
    assert alg.dynamic_sampling.enable and alg.dynamic_sampling.metric == "acc"
    assert spec.platform.world_size == 128


def test_extends_chain_merges_and_child_wins(tmp_path, write_job):
    write_job({"rollout": {"temperature": 0.5, "top_p": 0.9}}, name="grand.toml")
    (tmp_path / "parent.toml").write_text('extends = "grand.toml"\n[rollout]\ntemperature = 0.7\n')
    (tmp_path / "child.toml").write_text('extends = "parent.toml"\n[job]\nname = "kid"\n')
    spec, report = load(tmp_path / "child.toml")
    assert spec.rollout.temperature == 0.7 and spec.rollout.top_p == 0.9 and spec.job.name == "kid"
    assert report.where("rollout.temperature").file.endswith("parent.toml")
    assert report.where("rollout.temperature").line == 3


def test_extends_relative_to_the_file(tmp_path, write_job, monkeypatch):
    sub = tmp_path / "sub"
    sub.mkdir()
    write_job(name="base.toml")
    (sub / "job.toml").write_text('extends = "../base.toml"\n')
    monkeypatch.chdir(REPO)
    spec, _ = load(sub / "job.toml")
    assert spec.job.name == "job"  # default name: the job file's stem


def test_overrides_are_typed_from_the_schema(write_job):
    spec, report = load(write_job(), [
        "actor.optim.lr=2e-6", "rollout.temperature=1", "rollout.do_sample=false", "rollout.stop_token_ids=1,2",
        "data.train_files=[\"a.parquet\"]", "data.generator=none", "job.name=run 7", "algorithm.kl_loss.estimator=k3+",
        "rollout.max_model_len=none", "rollout.engine_kwargs.swap_space=4", "algorithm.kl_loss.enable=yes",
    ])
    assert spec.actor.optim.lr == 2e-6
    assert spec.rollout.temperature == 1.0 and isinstance(spec.rollout.temperature, float)
    assert spec.rollout.do_sample is False
    assert spec.rollout.stop_token_ids == (1, 2)
    assert spec.data.train_files == (str(Path.cwd() / "a.parquet"),)   # an override: against the working directory
    assert spec.job.name == "run 7"
    assert spec.algorithm.kl_loss.estimator == "k3+" and spec.algorithm.kl_loss.enable
    assert spec.rollout.max_model_len == 64 + 32  # none -> derived again
    assert spec.rollout.engine_kwargs == {"swap_space": 4}
    assert str(report.where("actor.optim.lr")) == "command line"


def test_overrides_take_toml_values_with_bare_strings_in_lists(write_job):
    """`key=[a.parquet,b.parquet]` is a list of two paths (not `[a.parquet` and `b.parquet]`);
    quoted elements keep their commas; inline tables and quoted strings are TOML."""
    spec, report = load(write_job(), [
        "data.generator=none", "data.train_files=[a.parquet,b.parquet]", 'data.val_files=["x,y.parquet", z.parquet]',
        'tracking.backends=[console, wandb]', 'tracking.tags={team = "rl", run = "7"}', 'job.description="a, b"',
        "rollout.stop_token_ids=[1, 2]",
    ])
    assert spec.data.train_files == (str(Path.cwd() / "a.parquet"), str(Path.cwd() / "b.parquet"))
    assert spec.data.val_files == (str(Path.cwd() / "x,y.parquet"), str(Path.cwd() / "z.parquet"))
    assert spec.tracking.backends == ("console", "wandb")
    assert spec.tracking.tags == {"team": "rl", "run": "7"}
    assert spec.job.description == "a, b" and spec.rollout.stop_token_ids == (1, 2)
    assert not [w for w in report.warnings if "does not exist on this machine" not in w]


def test_resolve_fills_derived_fields(write_job):
    spec, _ = load(write_job({"algorithm": {"advantage": "gae", "policy_loss": "sapo"}}))
    assert spec.critic.enable is True and spec.ref.enable is False
    assert spec.algorithm.loss_aggregation == "seq-mean-token-mean"
    assert spec.actor.mini_batch_prompts == spec.data.prompts_per_step == spec.critic.mini_batch_prompts
    assert spec.rollout.dtype == "float32" and spec.rollout.weight_sync.dtype == "float32"
    assert spec.parallel.expert_tensor == spec.parallel.tensor


def test_sections_are_frozen(write_job):
    spec, _ = load(write_job())
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.rollout.temperature = 2.0


def _leaf_fields(cls, prefix=""):
    for f in dataclasses.fields(cls):
        info = fields_of(cls)[f.name]
        sub = section_of(info.type)
        if sub is not None:
            yield from _leaf_fields(sub, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f, info


def test_optional_fields_default_to_none():
    # TOML has no null: `mrl show` leaves None out, so an Optional must default to None to round-trip.
    bad = [k for k, f, info in _leaf_fields(JobSpec) if optional_inner(info.type) is not None and f.default is not None]
    assert not bad


def test_every_field_has_help():
    assert not [k for k, _, info in _leaf_fields(JobSpec) if not info.meta.get("help")]


def test_verl_migration_table_targets_exist():
    valid = set(all_keys(JobSpec))
    assert not [v for v in VERL_TO_MRL.values() if v not in valid]


def test_keys_command_lists_every_leaf(cli):
    rc, out, _ = cli("keys", "rollout.")
    assert rc == 0 and "rollout.responses_per_prompt" in out and "actor.optim.lr" not in out


def test_internal_error_exits_1_with_traceback(cli, monkeypatch, write_job):
    import mrl.config.validate as validate

    def boom(spec, report):
        raise RuntimeError("bug in a check")

    monkeypatch.setattr(validate, "check", boom)
    rc, _, err = cli("validate", write_job())
    assert rc == 1 and "Traceback" in err and "bug in a check" in err


def test_command_line_exit_codes_end_to_end(write_job):
    bad = write_job({"rollout": {"temprature": 1.0}})
    proc = subprocess.run([sys.executable, "-m", "mrl", "validate", str(bad)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "rollout.temprature: unknown key; did you mean `rollout.temperature`?" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "mrl", "validate", "jobs/quickstart_cpu.toml"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr


def test_contributing_lists_the_verl_table():
    text = (REPO / "CONTRIBUTING.md").read_text()
    assert not [k for k, v in VERL_TO_MRL.items() if f"| `{k}` | `{v}` |" not in text]


def test_verl_lora_keys_are_suggested_or_explained(write_job):
    from mrl.config.loader import load
    from mrl.errors import SpecError

    with pytest.raises(SpecError) as e:
        load(write_job(), ["actor_rollout_ref.model.lora.alpha=32", "actor_rollout_ref.rollout.layered_summon=true"])
    text = "\n".join(e.value.problems)
    assert "actor_rollout_ref.model.lora.alpha: unknown key; did you mean `actor.lora.alpha`?" in text
    assert "actor_rollout_ref.rollout.layered_summon: not an mrl key: weight sync streams merged weights" in text


def test_contributing_lists_the_not_applicable_verl_keys():
    from mrl.config.suggest import VERL_NOT_APPLICABLE
    text = (REPO / "CONTRIBUTING.md").read_text()
    assert not [k for k in VERL_NOT_APPLICABLE if f"| `{k}` |" not in text]
    assert not set(VERL_NOT_APPLICABLE) & set(VERL_TO_MRL)


def test_a_child_file_unsets_a_key_its_base_set(tmp_path):
    base = (REPO / "jobs/quickstart_cpu.toml").read_text()
    assert "max_staleness" not in base
    (tmp_path / "base.toml").write_text(base.replace("[rollout]", "[rollout]\nmax_model_len = 4096\n", 1))
    from mrl.config.files import read_spec_file
    from mrl.config.report import Report
    raw = read_spec_file(tmp_path / "base.toml", Report(main_file="base.toml"))
    assert raw["rollout"]["max_model_len"] == 4096 and raw["job"]["description"].startswith("GRPO on CPU")
    (tmp_path / "child.toml").write_text('extends = "base.toml"\nunset = ["rollout.max_model_len", "job.description"]\n')
    report = Report(main_file="child.toml")
    child = read_spec_file(tmp_path / "child.toml", report)
    assert "max_model_len" not in child["rollout"] and "description" not in child["job"]
    assert "rollout.max_model_len" not in report.origins and child["rollout"]["engine"] == "hf"
    spec, _ = load(tmp_path / "child.toml", [f"data.generator={REPO / 'jobs/tasks/digits.py'}:prompts",
                                             f"reward.function={REPO / 'jobs/tasks/digits.py'}:score"])
    assert spec.job.description == "" and spec.rollout.max_model_len == 64 + 8   # defaults: derived again


@pytest.mark.parametrize("text, fragment", [
    ('unset = ["rollout.max_model_len"]\n', "only means something in a file that `extends`"),
    ('extends = "base.toml"\nunset = "rollout.max_model_len"\n', "must be a list of dotted keys"),
    ('extends = "base.toml"\nunset = ["rollout.max_model_lenn"]\n', "max_model_len"),
])
def test_unset_mistakes_are_one_line(tmp_path, text, fragment):
    from mrl.errors import SpecError

    (tmp_path / "base.toml").write_text((REPO / "jobs/quickstart_cpu.toml").read_text())
    (tmp_path / "child.toml").write_text(text)
    with pytest.raises(SpecError) as e:
        load(tmp_path / "child.toml")
    assert fragment in str(e.value) and "unset" in str(e.value) and "\n" not in str(e.value)
