"""`mrl convert` (verl config -> mrl job) and the verl key table it shares with the suggestions and
`mrl keys --verl`: typical verl GRPO and PPO configs convert into jobs that validate, values are
translated (sequence counts -> token budgets, booleans -> mrl's choices), every verl key is mapped
or explained, and every table entry suggests its own target."""
from __future__ import annotations

import json
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mrl.config.job import JobSpec
from mrl.config.suggest import explain_unknown
from mrl.config.verl_table import verl_table
from mrl.convert import convert, render
from mrl.convert.rules import RULES
from mrl.convert.verl_config import verl_defaults
from mrl.schema.section import all_keys

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

# Typical verl configurations as users write them (GRPO without a critic, PPO with one).
GRPO_YAML = """\
data:
  train_files: /data/gsm8k/train.parquet
  val_files: /data/gsm8k/test.parquet
  train_batch_size: 128
  max_prompt_length: 512
  max_response_length: 1024
actor_rollout_ref:
  model:
    path: Qwen/Qwen2.5-7B-Instruct
  actor:
    optim:
      lr: 1e-6
    use_kl_loss: true # KL penalty in loss function
    kl_loss_coef: 0.001
    ppo_mini_batch_size: 64
    ppo_micro_batch_size_per_gpu: 2
  rollout:
    name: vllm
    n: 8 # 8 responses per prompt (key for GRPO)
    temperature: 1.0
    tensor_model_parallel_size: 2
    gpu_memory_utilization: 0.5
algorithm:
  adv_estimator: grpo # group-relative advantage
trainer:
  n_gpus_per_node: 4
  total_epochs: 20
"""

PPO_YAML = """\
data:
  train_files: /data/gsm8k/train.parquet
  val_files: /data/gsm8k/test.parquet
  train_batch_size: 256
  max_prompt_length: 512
  max_response_length: 512
actor_rollout_ref:
  model:
    path: Qwen/Qwen2.5-7B-Instruct
  actor:
    optim:
      lr: 1e-6
    ppo_mini_batch_size: 64
    ppo_micro_batch_size_per_gpu: 4
    ppo_epochs: 1
    clip_ratio: 0.2
    grad_clip: 1.0
    entropy_coeff: 0.0
    use_torch_compile: true
  rollout:
    name: vllm
    tensor_model_parallel_size: 1
    gpu_memory_utilization: 0.4
    temperature: 1.0
    top_p: 1.0
    n: 1 # 1 response per prompt for PPO
  ref:
    log_prob_micro_batch_size_per_gpu: 4
critic:
  model:
    path: Qwen/Qwen2.5-7B-Instruct # same or separate critic model
  optim:
    lr: 1e-5
  ppo_micro_batch_size_per_gpu: 4
algorithm:
  adv_estimator: gae # Generalized Advantage Estimation
  kl_ctrl:
    kl_coef: 0.001
trainer:
  n_gpus_per_node: 4
  nnodes: 1
  total_epochs: 15
  save_freq: 10
  logger: ["console", "wandb"]
  project_name: ppo-gsm8k
"""

SCRIPT = r"""#!/bin/bash
set -x
train_path=/data/gsm8k/train.parquet
python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=$train_path \
    data.train_batch_size=32 \
    data.max_prompt_length=256 \
    data.max_response_length=768 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.optim.lr=3e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=12000 \
    actor_rollout_ref.actor.fsdp_config.param_offload=True \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.free_cache_engine=False \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
    trainer.logger='["console","mlflow"]' \
    trainer.n_gpus_per_node=2 \
    +trainer.my_own_flag=1 \
    trainer.total_epochs=3 $@
"""


def _data(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"data_source": ["openai/gsm8k"], "prompt": [[{"role": "user", "content": "1+1?"}]],
                             "reward_model": [{"style": "rule", "ground_truth": "2"}]}), path)
    return path


def _given(tmp_path):
    """The values a converted job still needs on this machine: the tiny model and a data file."""
    data = _data(tmp_path)
    return ["model.path=builtin:tiny-qwen2", f"data.train_files=[\"{data}\"]", f"data.val_files=[\"{data}\"]",
            "critic.model_path=builtin:tiny-qwen2"]


def _job(path):
    return tomllib.loads(path.read_text())


@pytest.mark.parametrize("name, text", [("grpo", GRPO_YAML), ("ppo", PPO_YAML)])
def test_verl_yaml_converts_into_a_job_that_validates(cli, tmp_path, name, text):
    src, out = tmp_path / f"{name}.yaml", tmp_path / f"{name}.toml"
    src.write_text(text)
    rc, _, err = cli("convert", src, "-o", out)
    assert rc == 0, err
    assert "defaults dropped" in err and f"ok: {out}" in err
    rc, _, err = cli("validate", out, *[g for g in _given(tmp_path) if name == "ppo" or "critic" not in g])
    assert rc == 0, err


def test_grpo_values_are_translated(tmp_path):
    src = tmp_path / "grpo.yaml"
    src.write_text(GRPO_YAML)
    job = tomllib.loads(render(convert([src], [])))
    assert job["data"]["prompts_per_step"] == 128
    assert job["rollout"]["responses_per_prompt"] == 8 and job["rollout"]["max_response_tokens"] == 1024
    assert job["actor"]["mini_batch_prompts"] == 64
    assert job["actor"]["micro_batch_tokens"] == 2 * (512 + 1024)   # 2 sequences at the longest length
    assert job["algorithm"]["advantage"] == "grpo" and job["algorithm"]["kl_loss"]["enable"] is True
    assert job["trainer"]["epochs"] == 20 and "total_steps" not in job["trainer"]
    assert job["platform"]["ranks_per_node"] == 4
    assert job["data"]["prompt_overflow"] == "error"          # verl's truncation='error' default
    assert job["reward"]["builtin"] == "auto"                 # verl's default_compute_score by data source
    assert job["tracking"]["backends"] == ["console", "wandb"]   # verl's logger, each to its mrl backend
    assert "critic" not in job                                # GRPO: verl reads no critic settings


def test_ppo_values_are_translated(tmp_path):
    src = tmp_path / "ppo.yaml"
    src.write_text(PPO_YAML)
    text = render(convert([src], []))
    job = tomllib.loads(text)
    assert job["algorithm"]["advantage"] == "gae"
    assert job["critic"]["micro_batch_tokens"] == 4 * 1024 and job["critic"]["optim"]["lr"] == 1e-5
    assert job["critic"]["model_path"] == "Qwen/Qwen2.5-7B-Instruct"
    assert job["ref"]["micro_batch_tokens"] == 4 * 1024
    assert job["checkpoint"]["every_steps"] == 10 and job["tracking"]["experiment"] == "ppo-gsm8k"
    assert "kl_reward" not in job["algorithm"]   # kl_ctrl is read only with use_kl_in_reward (false)
    assert "4 sequences x 1024 tokens" in text   # the comment says how the budget was computed


def test_command_line_script_converts(cli, tmp_path):
    script, out = tmp_path / "run_qwen2.sh", tmp_path / "run.toml"
    script.write_text(SCRIPT)
    rc, _, err = cli("convert", script, "-o", out)
    assert rc == 0, err
    text = out.read_text()
    job = tomllib.loads(text)
    assert job["data"]["train_files"] == ["/data/gsm8k/train.parquet"]    # the script's shell variable
    assert job["data"]["prompt_overflow"] == "drop"                        # filter_overlong_prompts=True
    assert job["actor"]["micro_batch_tokens"] == 12000                     # dynamic batching: a token budget
    # verl's ref.log_prob_use_dynamic_bsz and its token limit follow the actor's (interpolations):
    # the per-GPU sequence count is then ignored
    assert job["ref"]["micro_batch_tokens"] == 12000
    assert job["rollout"]["sleep_level"] == 0                              # free_cache_engine=False
    assert job["tracking"]["backends"] == ["console", "mlflow"]
    assert job["actor"]["optim"]["lr"] == 3e-6 and job["trainer"]["epochs"] == 3
    # explained, not silently dropped
    assert "# actor_rollout_ref.actor.fsdp_config.param_offload = True: parameter offload is not implemented" in text
    assert "# trainer.my_own_flag = 1: not in mrl's verl key table" in text
    rc, _, err = cli("validate", out, *_given(tmp_path)[:3])
    assert rc == 0, err


def test_a_pasted_command_line_converts_with_hydra_flags(cli, tmp_path):
    rc, out, err = cli("convert", "python3", "-m", "verl.trainer.main_ppo", "--config-name=ppo_trainer",
                       "algorithm.adv_estimator=rloo", "actor_rollout_ref.rollout.n=4", "data.train_batch_size=8",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.model.path=builtin:tiny-qwen2",
                       "~trainer.logger", "++trainer.val_before_train=false", f"data.train_files={_data(tmp_path)}")
    assert rc == 0, err
    job = tomllib.loads(out)
    assert job["algorithm"]["advantage"] == "rloo" and job["rollout"]["responses_per_prompt"] == 4
    assert job["trainer"]["val_before_train"] is False     # set by ++ (verl's default is true)
    assert job["trainer"]["epochs"] == 30                  # verl's default total_epochs, not mrl's 1
    assert "backends" not in job.get("tracking", {})       # ~trainer.logger deleted it: mrl's default


def test_missing_values_are_named(cli, tmp_path):
    rc, _, err = cli("convert", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
                     "data.truncation=right", "-o", tmp_path / "job.toml")
    assert rc == 2
    assert "model.path: missing required key" in err                 # verl's example path is not carried over
    assert "data.truncation = 'right'" in err and "data.prompt_overflow" in err
    assert (tmp_path / "job.toml").exists()


def test_interpolations_are_resolved(tmp_path):
    src = tmp_path / "v.yaml"
    src.write_text(textwrap.dedent("""\
        data:
          max_prompt_length: 100
          max_response_length: ${oc.select:custom.length,300}
        actor_rollout_ref:
          actor:
            ppo_micro_batch_size_per_gpu: 3
          rollout:
            n: ${.temperature_n}
            temperature_n: 6
          model:
            path: ${oc.env:MRL_TEST_UNSET_VARIABLE}
        """))
    conv = convert([src], [])
    assert conv.values["rollout.max_response_tokens"].value == 300
    assert conv.values["actor.micro_batch_tokens"].value == 3 * 400
    assert conv.values["rollout.responses_per_prompt"].value == 6
    assert [k for k, _, why in conv.not_converted if "MRL_TEST_UNSET_VARIABLE" in why] == ["actor_rollout_ref.model.path"]


def test_a_dumped_full_verl_config_drops_its_defaults(tmp_path):
    """A YAML that verl dumped holds every default: only what differs (or matters) is written."""
    import yaml

    tree: dict = {}
    for key, value in verl_defaults().items():
        node = tree
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    tree["actor_rollout_ref"]["rollout"]["n"] = 5
    src = tmp_path / "full.yaml"
    src.write_text(yaml.safe_dump(tree))
    conv = convert([src], [])
    assert len(conv.dropped) > 400 and not conv.not_converted
    assert conv.values["rollout.responses_per_prompt"].value == 5
    assert f"{len(conv.dropped)} verl keys were dropped" in render(conv)


def test_megatron_strategy_uses_megatron_defaults_and_layout(tmp_path):
    conv = convert([], ["actor_rollout_ref.actor.strategy=megatron",
                        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"])
    assert conv.values["parallel.tensor"].value == 2 and conv.values["parallel.pipeline"].value == 2


def test_critic_keys_of_a_grpo_job_are_listed_as_not_read():
    conv = convert([], ["algorithm.adv_estimator=grpo", "critic.optim.lr=3e-5"])
    assert "critic.optim.lr" not in conv.values
    assert [k for k, _, _ in conv.not_read] == ["critic.optim.lr"]


# ---- the table --------------------------------------------------------------------------------

def test_every_table_entry_suggests_its_own_target():
    """Each verl key of the table, set in a job, is answered with its mrl key (or its reason)."""
    valid = all_keys(JobSpec)
    table = verl_table()
    wrong = []
    for verl, entry in table.mapped.items():
        if verl in valid:
            continue   # the same name in mrl: not unknown
        parent = verl.rpartition(".")[0]
        siblings = [k.rsplit(".", 1)[-1] for k in valid if k.rpartition(".")[0] == parent]
        message = explain_unknown(verl, siblings, valid)
        if f"did you mean `{entry.target}`?" not in message:
            wrong.append((verl, entry.target, message))
    for verl, reason in table.not_applicable.items():
        if f"not an mrl key: {reason}" not in explain_unknown(verl, [], valid):
            wrong.append((verl, reason))
    for prefix, reason in table.prefixes.items():
        if f"not an mrl key: {reason}" not in explain_unknown(prefix + "some_key", [], valid):
            wrong.append((prefix, reason))
    assert not wrong


def test_total_epochs_suggests_epochs_not_total_steps(write_job):
    from mrl.config.loader import load
    from mrl.errors import SpecError

    with pytest.raises(SpecError) as e:
        load(write_job(), ["trainer.total_epochs=15"])
    assert "trainer.total_epochs: unknown key; did you mean `trainer.epochs`?" in e.value.problems[0]


def test_table_entries_are_well_formed():
    valid = set(all_keys(JobSpec))
    table = verl_table()
    assert not [(k, t) for k, m in table.mapped.items() for t in m.targets if t not in valid]
    assert not [k for k, m in table.mapped.items() if m.rule not in RULES]
    defaults = verl_defaults() | verl_defaults(megatron=True)
    known = set(defaults) | set(table.mapped)   # DAPO recipe keys are not in main_ppo's defaults
    assert not [c for c in table.read_only_when.values() if c.partition("=")[0] not in known]   # "key=a|b": values
    for m in table.mapped.values():   # a rule's parameters name verl keys (`why`: a reason; `prefix`: a table's)
        assert not [v for k, v in m.params.items() if k not in ("why", "prefix")
                    if isinstance(v, str) and v not in defaults and not v.startswith("reward_model.")]   # 0.8 reward_model keys
        if "prefix" in m.params:
            assert m.params["prefix"] == m.verl + "."


def test_nested_verl_tables_get_suggestions_inside(write_job):
    from mrl.config.loader import load
    from mrl.errors import SpecError

    path = write_job()
    path.write_text(path.read_text() + textwrap.dedent("""
        [actor_rollout_ref.actor]
        ppo_mini_batch_size = 4
        use_remove_padding = true
        [actor_rollout_ref.actor.fsdp_config]
        param_offload = true
        """))
    with pytest.raises(SpecError) as e:
        load(path)
    text = "\n".join(e.value.problems)
    assert "actor_rollout_ref: unknown table; it is verl's: `mrl convert`" in text
    assert "actor_rollout_ref.actor.ppo_mini_batch_size: unknown key; did you mean `actor.mini_batch_prompts`?" in text
    assert "actor_rollout_ref.actor.use_remove_padding: not an mrl key: always on" in text
    assert "actor_rollout_ref.actor.fsdp_config.param_offload: not an mrl key: parameter offload" in text


def test_new_hints(write_job):
    from mrl.config.loader import load
    from mrl.errors import SpecError

    with pytest.raises(SpecError) as e:
        load(write_job(), ["data.truncation=left", "actor_rollout_ref.model.use_remove_padding=true",
                           "actor_rollout_ref.ref.fsdp_config.param_offload=true"])
    text = "\n".join(e.value.problems)
    assert "data.truncation: unknown key; did you mean `data.prompt_overflow`?" in text
    assert "use_remove_padding: not an mrl key" in text and "ref.fsdp_config.param_offload: not an mrl key" in text


def test_keys_verl_lists_the_table(cli):
    rc, out, _ = cli("keys", "--verl", "--json")
    rows = json.loads(out)
    assert rc == 0 and {"verl": "trainer.total_epochs", "mrl": "trainer.epochs", "how": ""} in rows
    assert len(rows) >= len(verl_table().mapped) + len(verl_table().not_applicable)
    rc, out, _ = cli("keys", "--verl", "actor_rollout_ref.actor.ppo_micro")
    assert rc == 0 and "actor.micro_batch_tokens" in out and "trainer.epochs" not in out


def test_keys_of_a_verl_section_is_an_error_with_a_hint(cli):
    rc, out, err = cli("keys", "actor_rollout_ref")
    assert rc == 2 and not out
    assert "no mrl key starts with this; it is a verl name: `mrl keys --verl actor_rollout_ref`" in err
    rc, _, err = cli("keys", "no_such_section")
    assert rc == 2 and "no mrl key starts with this" in err


def test_contributing_lists_the_whole_table():
    """CONTRIBUTING.md's verl tables are what tools/verl/contributing_table.py writes from the data."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "verl" / "contributing_table.py"
    spec = importlib.util.spec_from_file_location("contributing_table", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    text = tool.PAGE.read_text()
    assert not [row for rows in tool.tables().values() for row in rows.splitlines() if row not in text]


def test_lora_modules_become_hugging_face_names():
    conv = convert([], ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"])
    assert conv.values["actor.lora.rank"].value == 8
    assert "actor.lora.target_modules" not in conv.values      # verl's all-linear = mrl's default, all seven
    conv = convert([], ["actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.model.lora.rank=4",
                        "actor_rollout_ref.model.lora.target_modules=[linear_qkv,linear_fc2]"])
    assert conv.values["actor.lora.target_modules"].value == ["q_proj", "k_proj", "v_proj", "down_proj"]
    conv = convert([], ["actor_rollout_ref.model.lora_alpha=64"])   # rank 0: verl builds no adapters
    assert "actor.lora.alpha" not in conv.values and [k for k, _, _ in conv.not_read] == ["actor_rollout_ref.model.lora_alpha"]


def test_validating_a_verl_yaml_points_to_convert(cli, tmp_path):
    src = tmp_path / "grpo.yaml"
    src.write_text(GRPO_YAML)
    rc, _, err = cli("validate", src)
    assert rc == 2 and "invalid TOML" in err and f"`mrl convert {src} -o job.toml`" in err


# ---- verl 0.9.1 algorithms ---------------------------------------------------------------------

# RolloutCorrectionConfig.bypass_pg_geo_rs_token_tis() written out (a preset is a Python constructor
# in verl: a config carries its fields), with PF-PPO and GDPO.
PRESET_PF_GDPO = ["algorithm.adv_estimator=gdpo", "+algorithm.gdpo_reward_keys=[acc,formatted]",
                  "+algorithm.gdpo_reward_weights=[1.0,0.5]",
                  "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_rs=seq_mean_k1",
                  "algorithm.rollout_correction.rollout_rs_threshold='0.999_1.001'",
                  "algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.loss_type=reinforce",
                  "algorithm.use_pf_ppo=true", "algorithm.pf_ppo.reweight_method=max_min",
                  "actor_rollout_ref.actor.kl_loss_type=low_var_kl+", "actor_rollout_ref.actor.use_kl_loss=true"]
# decoupled_k3_rs() (a float threshold) with clip_cov; kl_cov's parameters are not read with it.
K3_CLIP_COV = ["algorithm.adv_estimator=grpo_passk", "algorithm.rollout_correction.rollout_rs=seq_mean_k3",
               "algorithm.rollout_correction.rollout_rs_threshold=0.01",
               "actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov",
               "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.001",
               "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.5", "algorithm.kl_penalty=k1+",
               "algorithm.use_kl_in_reward=true", "actor_rollout_ref.actor.loss_agg_mode=token-sum"]
DPPO = ["algorithm.adv_estimator=opo", "actor_rollout_ref.actor.policy_loss.loss_mode=dppo_tv",
        "actor_rollout_ref.actor.clip_ratio_c=5.0", "algorithm.rollout_correction.rollout_is=sequence"]


def _verl_command(tmp_path, extra):
    return [*extra, "actor_rollout_ref.model.path=builtin:tiny-qwen2", f"data.train_files={_data(tmp_path)}",
            "actor_rollout_ref.rollout.n=4", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8"]


@pytest.mark.parametrize("name, extra", [("preset_pf_gdpo", PRESET_PF_GDPO), ("k3_clip_cov", K3_CLIP_COV),
                                         ("dppo", DPPO)])
def test_verl_algorithms_convert_into_jobs_that_validate(cli, tmp_path, name, extra):
    out = tmp_path / f"{name}.toml"
    rc, _, err = cli("convert", *_verl_command(tmp_path, extra), "-o", out)
    assert rc == 0, err
    rc, _, err = cli("validate", out)
    assert rc == 0, err


def test_a_verl_preset_converts_to_what_mrl_s_preset_means(tmp_path):
    """The fields of verl's bypass_pg_geo_rs_token_tis() convert to the algorithm that mrl's
    correction.preset of that name resolves to."""
    from mrl.algos.config import AlgorithmConfig, CorrectionConfig
    from mrl.algos.rejection_spec import expand_preset
    from mrl.config.loader import load

    src = tmp_path / "job.toml"
    src.write_text(render(convert([], _verl_command(tmp_path, PRESET_PF_GDPO))))
    alg = load(src)[0].algorithm
    preset = expand_preset(AlgorithmConfig(correction=CorrectionConfig(preset="bypass_pg_geo_rs_token_tis")))
    assert (alg.policy_loss, alg.correction) == (preset.policy_loss, preset.correction)
    assert (alg.advantage, alg.gdpo_reward_keys, alg.gdpo_reward_weights) == ("gdpo", ("acc", "formatted"), (1.0, 0.5))
    assert not alg.pf_ppo.enable   # verl 0.9.1 applies PF-PPO only in its GAE branch: with gdpo it is off
    assert alg.kl_loss.estimator == "low_var_kl+"                # verl's own KL names pass through


def test_verl_algorithm_values_are_translated():
    conv = convert([], K3_CLIP_COV)
    v = {k: c.value for k, c in conv.values.items()}
    assert v["algorithm.correction.rejection"] == "seq_mean_k3" and v["algorithm.correction.rejection_threshold"] == 0.01
    assert v["algorithm.policy_loss"] == "clip_cov" and v["algorithm.clip_cov_ratio"] == 0.001
    assert v["algorithm.loss_aggregation"] == "token-sum" and v["algorithm.kl_reward.estimator"] == "k1+"
    assert "algorithm.kl_cov_ratio" not in v and "algorithm.kl_cov_coef" not in v   # read only with kl_cov
    assert ("actor_rollout_ref.actor.policy_loss.kl_cov_ratio" in [k for k, _, _ in conv.not_read])
    assert "algorithm.correction.old_logprobs" not in v          # bypass_mode false = mrl's recompute
    assert "algorithm.pf_ppo.method" not in v                    # use_pf_ppo false: not read
    conv = convert([], ["actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov", "algorithm.adv_estimator=grpo_vectorized"])
    v = {k: c.value for k, c in conv.values.items()}
    assert "algorithm.kl_cov_coef" not in v   # verl's default ppo_kl_coef 0.1 is mrl's default: dropped as such
    assert ("actor_rollout_ref.actor.policy_loss.ppo_kl_coef", 0.1, "verl's default, = algorithm.kl_cov_coef default") \
        in conv.dropped
    assert v["algorithm.advantage"] == "grpo"
    conv = convert([], DPPO)
    v = {k: c.value for k, c in conv.values.items()}
    assert (v["algorithm.policy_loss"], v["algorithm.correction.level"], v["algorithm.dual_clip"]) == \
        ("dppo_tv", "sequence", 5.0)
    # in bypass mode verl's loss is loss_type's (ppo_clip by default): loss_mode is not read
    conv = convert([], [*DPPO, "algorithm.rollout_correction.bypass_mode=true"])
    v = {k: c.value for k, c in conv.values.items()}
    assert v["algorithm.correction.old_logprobs"] == "rollout" and "algorithm.policy_loss" not in v   # mrl's ppo
    # ... and verl 0.9.1 computes the IS weights of bypass + ppo_clip for metrics only
    assert [k for k, _, _ in conv.not_read] == ["actor_rollout_ref.actor.policy_loss.loss_mode",
                                                "algorithm.rollout_correction.rollout_is"]


def test_a_custom_reward_function_is_called_with_verl_s_arguments(cli, tmp_path):
    """verl calls compute_score(data_source=, solution_str=, ground_truth=, extra_info=) by name, also
    a function that takes only **kwargs (which mrl's auto detection cannot tell from parameter
    names): the converted job says reward.signature = "verl" and validates."""
    fn = tmp_path / "my_reward.py"
    fn.write_text("def my_score(**kwargs):\n    return float(kwargs['ground_truth'] in kwargs['solution_str'])\n")
    command = _verl_command(tmp_path, [f"custom_reward_function.path={fn}", "custom_reward_function.name=my_score"])
    conv = convert([], command)
    assert conv.values["reward.function"].value == f"{fn}:my_score"
    assert conv.values["reward.signature"].value == "verl" and "reward.builtin" not in conv.values
    out = tmp_path / "job.toml"
    rc, _, err = cli("convert", *command, "-o", out)
    assert rc == 0, err
    assert tomllib.loads(out.read_text())["reward"]["signature"] == "verl"


DISTILL_SCRIPT = """#!/usr/bin/env bash
# verl 0.9's on-policy distillation keys (examples/on_policy_distillation_trainer/run_qwen3_8b_fsdp.sh, v0.9.0)
python3 -m verl.trainer.main_ppo \\
    data.train_files="['/data/gsm8k/train.parquet']" data.max_prompt_length=256 data.max_response_length=512 \\
    data.train_batch_size=4 actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B \\
    distillation.enabled=True distillation.distillation_loss.loss_mode=k1 \\
    distillation.distillation_loss.topk=64 distillation.distillation_loss.use_task_rewards=False \\
    distillation.teacher_models.teacher_model.model_path=Qwen/Qwen2.5-0.5B-Instruct \\
    distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=1 \\
    actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.use_dynamic_bsz=True \\
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=3072 actor_rollout_ref.rollout.tensor_model_parallel_size=1 \\
    actor_rollout_ref.rollout.n=1 algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False \\
    trainer.n_gpus_per_node=1 trainer.nnodes=1
"""


def test_verl_on_policy_distillation_example_converts_to_a_valid_distill_job(cli, tmp_path):
    """verl 0.9.1's `distillation.enabled` selects mrl's distill advantage over the grpo estimator
    beside it (whatever the key order), and the teacher's path becomes distill.model_path."""
    script, out = tmp_path / "distill.sh", tmp_path / "distill.toml"
    script.write_text(DISTILL_SCRIPT)
    rc, _, err = cli("convert", script, "-o", out)
    # n = 1 is fine for the distill advantage; the Hub id teacher is what is left to supply (mrl train
    # reads a teacher from a local checkpoint, and validate refuses what train would)
    problems = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == 2 and len(problems) == 1 and "distill.model_path: 'Qwen/Qwen2.5-0.5B-Instruct' holds no weights" \
        in problems[0], err
    text = out.read_text()
    job = tomllib.loads(text)
    assert job["algorithm"]["advantage"] == "distill" and job["rollout"].get("responses_per_prompt", 1) == 1
    assert job["distill"]["model_path"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert "algorithm.adv_estimator = 'grpo' conflicts with distillation.enabled" in text
