"""verl's reward settings keep their meaning through `mrl convert`: verl 0.9's `reward.*`
namespace, the legacy `reward_model.*` / `custom_reward_function.*` keys verl 0.9.1 moves into it,
both spellings of DAPO's overlong penalty, the reward function's keyword arguments, scalar and
generative reward models. The four silent changes of issue 35 each have a test, and a walk over
every reward key of verl 0.9.1's configs checks that none is ever silently replaced."""
from __future__ import annotations

import pytest

from mrl.convert import convert
from mrl.convert.verl_config import NAMED_CONFIGS, verl_defaults

RM = "Skywork/Skywork-Reward-Llama-3.1-8B"


def _values(conv):
    return {k: c.value for k, c in conv.values.items()}


@pytest.mark.parametrize("spelling", ["reward.reward_model.enable=True reward.reward_model.model_path={rm}",
                                      "reward_model.enable=True reward_model.model.path={rm}"])
def test_a_scalar_reward_model_is_kept(spelling):
    """Silent change 1: verl 0.9's reward model (the Skywork RM example) became builtin "auto"."""
    conv = convert([], spelling.format(rm=RM).split())
    v = _values(conv)
    assert v["reward.model_path"] == RM
    assert "reward.builtin" not in v and "reward.judge.model" not in v
    assert conv.values["reward.model_path"].verl.endswith(("reward_model.enable", "reward_model.model_path",
                                                           "reward_model.model.path"))


@pytest.mark.parametrize("prefix", ["reward.custom_reward_function", "custom_reward_function"])
def test_a_custom_reward_function_and_its_kwargs_are_kept(prefix):
    """Silent change 2: verl 0.9's reward.custom_reward_function.path/name (the GDPO example) became
    "auto", and custom_reward_function.reward_kwargs.* were unmapped (docs/rewards.md: reward.kwargs)."""
    conv = convert([], [f"{prefix}.path=/r/rlla.py", f"{prefix}.name=compute_score",
                        f"+{prefix}.reward_kwargs.weight=2", f"+{prefix}.reward_kwargs.style.strict=true",
                        "algorithm.adv_estimator=gdpo",
                        "+algorithm.gdpo_reward_keys=[accuracy_reward,format_reward]"])
    v = _values(conv)
    assert v["reward.function"] == "/r/rlla.py:compute_score" and v["reward.signature"] == "verl"
    assert v["reward.kwargs"] == {"weight": 2, "style": {"strict": True}}
    assert "reward.builtin" not in v
    assert v["algorithm.gdpo_reward_keys"] == ["accuracy_reward", "format_reward"]


@pytest.mark.parametrize("overrides", [
    # verl-recipe's DAPO scripts on main_ppo (the spelling)
    ["reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
     "+reward_model.reward_kwargs.overlong_buffer_cfg.len=512", "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
     "+reward_model.reward_kwargs.max_resp_len=2048"],
    # verl 0.9's spelling
    ["reward.reward_manager.name=dapo", "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
     "+reward.reward_kwargs.overlong_buffer_cfg.len=512", "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5"],
    # the DAPO recipe's entry point (its config holds reward.reward_kwargs and the dapo manager)
    ["--config-name=dapo_trainer", "reward.reward_kwargs.overlong_buffer_cfg.enable=True",
     "reward.reward_kwargs.overlong_buffer_cfg.len=512", "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5"],
    # DAPO scripts before reward_kwargs
    ["reward_model.reward_manager=dapo", "+reward_model.overlong_buffer.enable=True", "+reward_model.overlong_buffer.len=512",
     "+reward_model.overlong_buffer.penalty_factor=0.5"],
])
def test_dapo_s_overlong_penalty_is_on(overrides):
    """Silent change 3: reward_model.reward_kwargs.overlong_buffer_cfg.* (and the 0.9 spelling)
    were unmapped, so algorithm.overlong.enable stayed false in every DAPO recipe."""
    name = next((o.partition("=")[2] for o in overrides if o.startswith("--config-name=")), None)
    conv = convert([], ["data.max_response_length=2048", *(o for o in overrides if not o.startswith("--"))],
                   **({"config_name": name} if name else {}))
    v = _values(conv)
    assert (v["algorithm.overlong.enable"], v["algorithm.overlong.buffer_tokens"], v["algorithm.overlong.penalty_factor"]) \
        == (True, 512, 0.5)
    assert not conv.problems


def test_overlong_buffer_is_read_only_with_the_dapo_manager_and_its_length():
    conv = convert([], ["+reward.reward_kwargs.overlong_buffer_cfg.enable=True", "+reward.reward_kwargs.overlong_buffer_cfg.len=512"])
    assert "algorithm.overlong.enable" not in conv.values
    assert [k for k, _, why in conv.not_read if k.endswith("overlong_buffer_cfg.enable") and "dapo reward manager" in why]
    conv = convert([], ["reward.reward_manager.name=dapo", "data.max_response_length=4096",
                        "+reward.reward_kwargs.overlong_buffer_cfg.enable=True", "+reward.reward_kwargs.max_resp_len=2048"])
    assert [p for p in conv.problems if "max_resp_len = 2048" in p and "rollout.max_response_tokens" in p]


GENRM = ["reward_model.enable=True", "reward_model.model.path=/m/genrm", "reward_model.rollout.name=vllm",
         "reward_model.rollout.tensor_model_parallel_size=2", "reward_model.rollout.gpu_memory_utilization=0.3",
         "reward_model.rollout.prompt_length=4096", "reward_model.rollout.response_length=1024",
         "custom_reward_function.path=/r/genrm_fn.py", "custom_reward_function.name=compute_score_genrm"]


def test_a_generative_reward_model_becomes_the_judge_on_an_engine():
    """Silent change 4: a generative reward model (a custom function prompts it, verl 0.9.1's
    reward loop) became a scalar value-head reward model."""
    conv = convert([], GENRM)
    v = _values(conv)
    assert "reward.model_path" not in v and "reward.function" not in v
    assert (v["reward.judge.model"], v["reward.judge.engine"], v["reward.judge.tensor_parallel"],
            v["reward.judge.gpu_memory_utilization"], v["reward.judge.max_model_len"], v["reward.judge.max_tokens"]) \
        == ("/m/genrm", "vllm", 2, 0.3, 5120, 1024)
    # the function's own prompt and parsing are the user's to carry over: asked for, by name
    assert [p for p in conv.problems if "/r/genrm_fn.py:compute_score_genrm" in p and "reward.judge.template" in p]
    # on GPUs of its own in verl: served, reward.judge.url
    conv = convert([], [*GENRM, "reward_model.enable_resource_pool=True"])
    assert [p for p in conv.problems if "reward.judge.url" in p]


def _reward_keys() -> dict[str, object]:
    """Every reward key of verl 0.9.1's configs (and the recipes'), with verl's default."""
    keys: dict[str, object] = {}
    for name in NAMED_CONFIGS:
        for k, v in verl_defaults(name=name).items():
            if k.startswith(("reward.", "reward_model.", "custom_reward_function.", "sandbox_fusion.")):
                keys.setdefault(k, v)
    return keys


def _other(value):
    """A value unlike verl's default, of the same kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 3
    if isinstance(value, float):
        return value + 0.25
    if value == {}:
        return None
    return "other_value"


CONTEXTS = {
    "generative RM, dapo manager": [*GENRM, "reward_model.reward_manager=dapo", "data.max_response_length=2048",
                                    "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True"],
    "scalar RM": ["reward.reward_model.enable=True", f"reward.reward_model.model_path={RM}"],
    "no RM": [],
}


@pytest.mark.parametrize("context", sorted(CONTEXTS))
def test_no_reward_key_is_ever_silently_replaced(context):
    """Each reward key of verl 0.9.1, set to a value other than verl's default, ends up in the job
    (with its name in the comment), among the keys with no counterpart or not read (with why), or in
    a problem naming it: never only in the count of dropped defaults."""
    keys = _reward_keys()
    assert len(keys) > 60
    walked = 0
    for key, default in sorted(keys.items()):
        value = _other(default)
        if value is None or key.endswith("._target_"):
            continue
        text = str(value).lower() if isinstance(value, bool) else str(value)
        conv = convert([], [*CONTEXTS[context], f"++{key}={text}"])
        named = {c.verl for c in conv.values.values()}
        listed = {k for k, _, _ in conv.not_converted + conv.not_read}
        said = " ".join(conv.problems + conv.notes + conv.refused)
        legacy = {key, *(k for k in named | listed if k.split(".")[-1] == key.split(".")[-1])}
        # named in the job, listed with why, or in a problem that names the key or shows its value
        assert named & legacy or listed & legacy or key in said or text in said, (context, key, value)
        assert key not in {k for k, _, _ in conv.dropped}, (context, key)
        walked += 1
    assert walked > 60
