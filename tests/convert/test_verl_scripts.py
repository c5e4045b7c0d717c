"""`mrl convert` over real verl launch scripts (tests/convert/verl_scripts/: verl v0.9.0's examples,
verl-recipe's DAPO, retool, FAPO and entropy scripts, and command lines of verl's docs, each kept
as published below a two-line source header): every one converts to a job that validates once a
model and data stand-in are given, or is refused in one line naming the capability mrl lacks or
the value it needs. And the details the old reader lost: named configs, recipe entry points,
`+key` on a null value, the multi-turn settings of a config YAML next to the script."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mrl.convert import convert, inputs

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

SCRIPTS = Path(__file__).with_name("verl_scripts")

# What becomes of each script: "valid" (validates with stand-ins), or ("refused", words of the one
# line), or ("invalid", words of the validation error: a limit of mrl's layout the job breaks).
EXPECTED: dict[str, object] = {
    "v090__grpo_trainer_run_qwen3_8b_fsdp.sh": "valid",
    "v090__grpo_trainer_run_qwen3_8b_megatron.sh": "valid",
    "v090__grpo_trainer_run_mistral_nemo_12b_skyworkrm_fsdp.sh": "valid",
    "v090__gdpo_trainer_run_qwen3_8b_fsdp.sh": "valid",
    "v090__cispo_trainer_run_qwen3_8b_fsdp.sh": "valid",
    "v090__gmpo_trainer_run_qwen3_8b_fsdp.sh": "valid",
    "v090__sapo_trainer_run_qwen3_8b_fsdp.sh": "valid",
    "v090__gspo_trainer_run_qwen3_8b_fsdp.sh": "valid",
    "v090__gpg_trainer_run_qwen3_8b_megatron.sh": "valid",
    "v090__otb_trainer_run_qwen3_8b_fsdp.sh": "valid",
    "v090__ppo_trainer_run_qwen3_8b_fsdp.sh": "valid",
    "v090__ppo_trainer_run_qwen3_8b_megatron.sh": "valid",
    "v090__reinforce_plus_plus_trainer_run_qwen3_8b_fsdp.sh": "valid",
    "v090__remax_trainer_run_qwen3_8b_fsdp.sh": "valid",
    "v090__rloo_trainer_run_qwen3_8b_fsdp.sh": "valid",
    "v090__tuning_lora_run_qwen3_8b_fsdp.sh": "valid",
    "v090__dppo_trainer_run_qwen3_30b_a3b_megatron.sh": "valid",
    "v090__prefix_grouper_run_qwen3_8b_fsdp.sh": "valid",
    "v090__grpo_trainer_run_qwen2-7b_math_megatron_fsdp.sh": "valid",
    "v090__router_replay_run_qwen3_30b_a3b_megatron.sh": ("invalid", "do not split evenly over data-parallel size"),
    "v090__rollout_correction_run_qwen2_5_7b_fsdp_multi_rs.sh": ("invalid", "needs >= 2 responses per prompt"),
    "v090__grpo_trainer_run_gpt_oss_20b_fsdp.sh": ("invalid", "is above parallel.tensor 1: a colocated sglang server"),
    "v090__sft_gsm8k_run_qwen3_8b_fsdp.sh": ("refused", "verl's SFT trainer"),
    "v090__generation_run_deepseek_llm_7b.sh": ("refused", "use `mrl generate`"),
    "v090__on_policy_distillation_trainer_run_qwen3_8b_fsdp.sh": ("invalid", "distill.model_path"),
    "v090__mtp_trainer_run_mimo_7b_mtp_fully_async_megatron_multinode.sh": ("refused", "fully asynchronous trainer"),
    "v090__ascend_extras_grpo_trainer_run_qwen3_30b_a3b_megatron.sh": ("refused", "Ascend NPUs"),
    "recipe__dapo_test_dapo_7b_math.sh": "valid",   # Ulysses sp_size 4 -> parallel.context 4
    "recipe__dapo_run_dapo_qwen2.5_32b.sh": "valid",   # Ulysses sp_size 8 -> parallel.context 8
    "recipe__dapo_test_dapo_7b_math_megatron.sh": "valid",
    "recipe__retool_run_qwen2_7b_dapo.sh": "valid",
    "recipe__fapo_run_fapo_7b.sh": ("invalid", "reward.judge.url"),
    "recipe__fapo_run_baseline_7b.sh": "valid",
    "recipe__entropy_7b_kl_cov.sh": "valid",
    "recipe__entropy_7b_clip_cov.sh": "valid",
    "docs__examples__gsm8k_example__6.sh": "valid",
    "docs__start__quickstart__11.sh": "valid",
}


def test_every_embedded_script_has_an_expectation():
    assert sorted(p.name for p in SCRIPTS.glob("*.sh")) == sorted(EXPECTED)
    assert len(EXPECTED) >= 30
    for path in SCRIPTS.glob("*.sh"):      # each keeps its source and licence header
        head = path.read_text().splitlines()[:2]
        assert "verl-project/verl" in head[0] and "Apache License 2.0" in head[1]


def _stand_ins(job: Path, tmp: Path) -> list[str]:
    """A model as large as the scripts' (config.json: validation reads the shape), one-row data, and
    empty stand-ins for the files a job names that live on the user's machine."""
    spec = tomllib.loads(job.read_text())
    data = tmp / "train.parquet"
    pq.write_table(pa.table({"data_source": ["openai/gsm8k"], "prompt": [[{"role": "user", "content": "1+1?"}]],
                             "reward_model": [{"style": "rule", "ground_truth": "2"}]}), data)
    par = spec.get("parallel", {})
    moe = par.get("expert", 1) > 1 or spec.get("rollout", {}).get("expert_parallel", False)
    model = tmp / ("moe" if moe else "dense")
    model.mkdir(exist_ok=True)
    config = dict(model_type="qwen3_moe" if moe else "qwen2", hidden_size=8192, intermediate_size=29568,
                  num_hidden_layers=96, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                  vocab_size=152064, max_position_embeddings=131072, tie_word_embeddings=False)
    if moe:
        config.update(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536)
    (model / "config.json").write_text(json.dumps(config))
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}<tool_call>"}))
    out = [f"model.path={model}", f'data.train_files=["{data}"]', f'data.val_files=["{data}"]']
    reward = spec.get("reward", {})
    if reward.get("model_path"):
        out.append(f"reward.model_path={model}")
    if str(reward.get("function", "")).partition(":")[0].endswith(".py"):
        fn = tmp / "reward_fn.py"
        name = reward["function"].rpartition(":")[2]
        fn.write_text(f"def {name}(data_source, solution_str, ground_truth, extra_info=None, **kw):\n    return 0.0\n")
        out.append(f'reward.function="{fn}:{name}"')
    tools = spec.get("rollout", {}).get("multi_turn", {}).get("tool_config")
    if tools:
        (tmp / "tools.yaml").write_text("tools: []\n")
        out.append(f'rollout.multi_turn.tool_config="{tmp / "tools.yaml"}"')
    if spec.get("critic", {}).get("enable") or spec.get("critic", {}).get("model_path"):
        out.append(f"critic.model_path={model}")
    return out


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_verl_script_converts_or_is_refused_in_one_line(cli, tmp_path, name, monkeypatch):
    monkeypatch.setenv("HOME", "/home/user")
    for var in ("MODEL_PATH", "DEVICE", "INFER_BACKEND", "NNODES", "NGPUS_PER_NODE"):
        monkeypatch.delenv(var, raising=False)
    expected = EXPECTED[name]
    job = tmp_path / "job.toml"
    rc, _, err = cli("convert", SCRIPTS / name, "-o", job)
    converted = err
    assert "Traceback" not in err
    if isinstance(expected, tuple) and expected[0] == "refused":
        lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert rc == 2 and len(lines) == 1 and expected[1] in lines[0], err
        assert not job.exists()
        return
    assert job.exists(), err
    rc, _, err = cli("validate", job, *_stand_ins(job, tmp_path))
    if expected == "valid":
        assert rc == 0, err
    else:
        assert rc == 2 and expected[1] in converted + err, converted + err


def _converted(name: str, *extra: str):
    found = inputs([str(SCRIPTS / name), *extra])
    conv = convert(found.yamls, found.tokens, config_name=found.config_name, describe=found.describe)
    return conv, {k: c.value for k, c in conv.values.items()}


def test_arrays_defaults_and_arithmetic_of_a_v090_script_are_read(monkeypatch):
    """grpo run_qwen3_8b_fsdp.sh: `${TRAIN_BATCH_SIZE:-1024}` into arrays, "${DATA[@]}" into the
    command, the device probe answered (no NPU), `case` on it taking the gpu branch."""
    monkeypatch.setenv("HOME", "/home/user")
    monkeypatch.delenv("DEVICE", raising=False)
    monkeypatch.setenv("ROLLOUT_N", "7")         # the environment wins over the script's default
    conv, v = _converted("v090__grpo_trainer_run_qwen3_8b_fsdp.sh")
    assert v["data.prompts_per_step"] == 1024 and v["actor.mini_batch_prompts"] == 256
    assert v["rollout.responses_per_prompt"] == 7
    assert v["rollout.tensor_parallel"] == 2 and v["rollout.gpu_memory_utilization"] == 0.6   # gpu branch
    assert v["data.train_files"] == ["/home/user/data/gsm8k/train.parquet", "/home/user/data/math/train.parquet"]
    # the experiment name holds $(date ...): not computed, listed, and the run is named by mrl
    assert [k for k, _, why in conv.not_converted if k == "trainer.experiment_name" and "computed by the script" in why]


def test_dapo_recipe_arithmetic(monkeypatch):
    """test_dapo_7b_math.sh: `$((1024 * 8))`, `$(((a + b) * 2))` (the issue's traceback), and the
    overlong penalty of `+reward_model.reward_kwargs.overlong_buffer_cfg.*` (with
    reward_model.reward_manager=dapo) switched on."""
    monkeypatch.setenv("HOME", "/home/user")
    conv, v = _converted("recipe__dapo_test_dapo_7b_math.sh")
    assert v["rollout.max_response_tokens"] == 8192 and v["data.max_prompt_tokens"] == 2048
    # $(((max_prompt_length + max_response_length) * 2)) per GPU of a Ulysses group of sp_size 4:
    # per rank of parallel.context 4
    assert v["actor.micro_batch_tokens"] == (2048 + 8192) * 2
    assert v["actor.logprob_micro_batch_tokens"] == (2048 + 8192) * 3
    assert v["parallel.context"] == 4
    assert (v["algorithm.overlong.enable"], v["algorithm.overlong.buffer_tokens"], v["algorithm.overlong.penalty_factor"]) \
        == (True, 4096, 1.0)
    # the model's max_position_embeddings override is listed with what to do, not dropped
    why = dict((k, r) for k, _, r in conv.not_converted)["actor_rollout_ref.model.override_config.max_position_embeddings"]
    assert "config.json" in why


def test_dapo_entry_point_composes_the_recipe_config(monkeypatch):
    """run_dapo_qwen2.5_32b.sh runs recipe.dapo.main_dapo: its dapo_trainer config applies (reward
    manager dapo), and the old `reward_model.overlong_buffer.*` spelling still turns the penalty on."""
    monkeypatch.setenv("HOME", "/home/user")
    conv, v = _converted("recipe__dapo_run_dapo_qwen2.5_32b.sh")
    assert "dapo_trainer defaults" in " ".join(conv.notes)
    assert v["algorithm.overlong.enable"] is True and v["algorithm.overlong.buffer_tokens"] == 4096
    assert v["parallel.context"] == 8   # Ulysses sp_size 8
    assert v["algorithm.dynamic_sampling.enable"] is True


def test_config_name_ppo_megatron_trainer_gets_megatron_defaults(monkeypatch):
    monkeypatch.setenv("HOME", "/home/user")
    conv, v = _converted("v090__ppo_trainer_run_qwen3_8b_megatron.sh")
    assert "ppo_megatron_trainer defaults" in " ".join(conv.notes)
    plain = convert([], ["data.train_batch_size=8"])          # no name: main_ppo's own ppo_trainer
    assert "ppo_trainer defaults" in " ".join(plain.notes)
    pasted = inputs(["python3", "-m", "verl.trainer.main_ppo", "--config-name=ppo_megatron_trainer", "data.train_batch_size=8"])
    conv = convert(pasted.yamls, pasted.tokens, config_name=pasted.config_name)
    assert "ppo_megatron_trainer defaults" in " ".join(conv.notes)
    conv = convert([], ["model_engine=megatron", "data.train_batch_size=8", "+trainer.total_epochs=3"])
    assert "ppo_megatron_trainer defaults (model_engine=megatron)" in " ".join(conv.notes)
    assert not [k for k, _, _ in conv.not_converted if "model_engine" in k]      # a choice of config, not a key
    assert [n for n in conv.notes if "read as ++trainer.total_epochs" in n]      # +key over a set key: said
    assert conv.values["trainer.epochs"].value == 3


def test_plus_key_on_a_null_default_is_accepted(monkeypatch):
    """router_replay: `+actor_rollout_ref.actor.router_replay.mode=...` where verl's value is null."""
    from mrl.convert.verl_config import verl_defaults

    assert verl_defaults()["actor_rollout_ref.rollout.max_model_len"] is None
    conv = convert([], ["+actor_rollout_ref.rollout.max_model_len=4096"])
    assert conv.values["rollout.max_model_len"].value == 4096


def test_config_name_of_a_yaml_next_to_the_script_keeps_multi_turn(tmp_path, monkeypatch):
    """A sglang_multiturn-style config named by --config-path/--config-name: its multi-turn
    settings reach the job (the old reader ignored --config-name)."""
    monkeypatch.setenv("HOME", "/home/user")
    conf = tmp_path / "config"
    conf.mkdir()
    (conf / "gsm8k_multiturn_grpo.yaml").write_text(
        "hydra:\n  searchpath:\n    - file://verl/trainer/config\n"
        "defaults:\n  - ppo_trainer\n  - _self_\n"
        "data:\n  max_prompt_length: 1024\n  max_response_length: 1024\n  train_batch_size: 256\n"
        "actor_rollout_ref:\n  rollout:\n    name: vllm\n    multi_turn:\n      enable: true\n"
        "      max_assistant_turns: 5\n")
    script = tmp_path / "run.sh"
    script.write_text('set -x\nPROJECT_DIR="$(pwd)"\nCONFIG_PATH="$PROJECT_DIR/config"\n'
                      f'cd {tmp_path}\n'
                      'python3 -m verl.trainer.main_ppo \\\n    --config-path="$CONFIG_PATH" \\\n'
                      "    --config-name='gsm8k_multiturn_grpo' \\\n    algorithm.adv_estimator=grpo \\\n"
                      '    actor_rollout_ref.rollout.multi_turn.tool_config_path="$PROJECT_DIR/tool.yaml" "$@"\n')
    monkeypatch.chdir(tmp_path)
    found = inputs([str(script)])
    assert found.yamls == [conf / "gsm8k_multiturn_grpo.yaml"]
    conv = convert(found.yamls, found.tokens, config_name=found.config_name, base=tmp_path)
    v = {k: c.value for k, c in conv.values.items()}
    assert v["rollout.multi_turn.enable"] is True and v["rollout.multi_turn.max_assistant_turns"] == 5
    assert v["rollout.multi_turn.tool_config"] == str(tmp_path / "tool.yaml")


def test_sglang_rollout_maps_to_the_sglang_engine():
    conv = convert([], ["actor_rollout_ref.rollout.name=sglang"])
    assert conv.values["rollout.engine"].value == "sglang"


def test_a_converted_sglang_job_validates(write_job):
    from mrl.config.loader import load

    load(write_job(), ["rollout.engine=sglang"])


def test_lora_load_format_safetensors_is_mrl_s_auto():
    """verl's LoRA examples load the base weights into the engine from the model path (safetensors):
    mrl's load_format "auto" does the same."""
    conv = convert([], ["actor_rollout_ref.rollout.load_format=safetensors"])
    assert conv.values["rollout.load_format"].value == "auto"
    conv = convert([], ["actor_rollout_ref.rollout.load_format=dummy"])
    assert "rollout.load_format" not in conv.values     # = mrl's default


def test_save_freq_minus_one_is_never_save():
    from mrl.checkpoint.config import saves_at

    conv = convert([], ["trainer.save_freq=-1"])
    assert conv.values["checkpoint.every_steps"].value == -1
    assert [s for s in range(1, 11) if saves_at(s, -1, 10)] == []
    assert [s for s in range(1, 11) if saves_at(s, 0, 10)] == [10]
    assert [s for s in range(1, 11) if saves_at(s, 4, 10)] == [4, 8, 10]


def test_cispo_clip_ratio_low_10_is_no_lower_clip(write_job):
    """CISPO's verl setting clip_ratio_low=10: 1 - 10 < 0, so no ratio is clipped from below (as in
    verl, where clamp(r, -9, ...) never acts); the job validates."""
    from mrl.config.loader import load

    conv = convert([], ["actor_rollout_ref.actor.policy_loss.loss_mode=cispo", "actor_rollout_ref.actor.clip_ratio_low=10",
                        "actor_rollout_ref.actor.clip_ratio_high=4"])
    assert conv.values["algorithm.clip_low"].value == 10 and "no lower clip" in conv.values["algorithm.clip_low"].note
    load(write_job(), ["algorithm.policy_loss=cispo", "algorithm.clip_low=10", "algorithm.clip_high=4"])


def test_cispo_no_lower_clip_equals_verl_s_clamp():
    """Hand-checkable: ratios 0.05 and 3.0 with eps_low 10, eps_high 4 -> weights 0.05 (no lower
    clip) and 3.0; verl clamps at [1 - 10, 1 + 4] = [-9, 5], the same."""
    import torch

    from mrl.algos.losses import cispo

    logp = torch.log(torch.tensor([[0.05, 3.0]]))
    loss, _ = cispo(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool), 10.0, 4.0)
    verl = -torch.clamp(torch.tensor([[0.05, 3.0]]), 1 - 10, 1 + 4) * logp
    assert torch.allclose(loss, verl)


def test_gmpo_and_sapo_loss_aggregation_is_not_read():
    for loss in ("geo_mean", "sapo"):
        conv = convert([], [f"actor_rollout_ref.actor.policy_loss.loss_mode={loss}",
                            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum"])
        assert "algorithm.loss_aggregation" not in conv.values
        assert [k for k, _, why in conv.not_read if k == "actor_rollout_ref.actor.loss_agg_mode" and "ignores" in why]


def test_is_threshold_lower_upper_is_icepop_mask():
    conv = convert([], ["algorithm.rollout_correction.rollout_is=token",
                        "algorithm.rollout_correction.rollout_is_threshold='0.5_4.0'"])
    v = {k: c.value for k, c in conv.values.items()}
    assert (v["algorithm.correction.mode"], v["algorithm.correction.mask_low"], v["algorithm.correction.mask_high"]) \
        == ("mask", 0.5, 4.0)


def test_npu_device_is_refused_in_one_line_and_distillation_supplied_by_hand(cli, tmp_path):
    rc, _, err = cli("convert", "trainer.device=npu", "-o", tmp_path / "a.toml")
    assert rc == 2 and err.count("error:") == 1 and "Ascend NPUs" in err and not (tmp_path / "a.toml").exists()
    # distillation without a teacher path converts, and the job asks for the teacher (one line)
    rc, _, err = cli("convert", "distillation.enabled=true", "actor_rollout_ref.model.path=builtin:tiny-llama",
                     "-o", tmp_path / "b.toml")
    assert "Traceback" not in err and (tmp_path / "b.toml").exists()
    assert "distill.model_path: algorithm.advantage = 'distill' needs a teacher" in err, err


def test_every_key_of_verl_0_9_1_is_mapped_or_explained():
    """The defaults table is verl 0.9.1's (sdist generated configs and the recipes'); each of its
    keys has an entry or a reason, so a config dumped by 0.9.1 lists no "no known counterpart" line."""
    from mrl.config.verl_table import verl_table
    from mrl.convert.verl_config import NAMED_CONFIGS, verl_defaults, verl_version

    assert verl_version() == "0.9.1"
    table = verl_table()
    keys = {k for name in NAMED_CONFIGS for k in verl_defaults(name=name)}
    assert len(keys) > 1300
    assert not sorted(k for k in keys if table.mapping(k) is None and table.reason(k) is None)
    dumped = convert([], ["++actor_rollout_ref.actor.veomni.param_offload=true", "++trainer.v1.sampler.x=1"])
    assert not [k for k, _, why in dumped.not_converted if "no known counterpart" in why]


def test_ulysses_maps_to_context_parallelism_with_the_per_rank_budget():
    """verl's ppo_max_token_len_per_gpu is per GPU of a Ulysses group: a micro-batch holds budget x
    sp tokens (the DAPO NPU scripts set (prompt + response) / sp). Ulysses becomes parallel.context,
    whose token budgets are per rank as well: the same numbers."""
    conv = convert([], ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2816",
                        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=8",
                        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
                        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=2816"])
    v = {k: c.value for k, c in conv.values.items()}
    assert v["actor.micro_batch_tokens"] == 2816
    assert v["ref.micro_batch_tokens"] == 2816      # the reference follows the actor's Ulysses size
    assert v["parallel.context"] == 8
    assert "Ulysses group of 8" in conv.values["actor.micro_batch_tokens"].note
