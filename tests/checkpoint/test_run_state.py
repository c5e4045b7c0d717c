"""The typed run state a checkpoint carries besides the weights: the `extra` keys older
checkpoints hold (so they resume and `mrl merge` reads them), and the round trip."""
from __future__ import annotations

import io

import torch

from mrl.checkpoint.run_state import ModelFacts, RunState

FACTS = ModelFacts(hf_config={"model_type": "qwen2"}, model_path="builtin:tiny-qwen2", tokenizer=None,
                   dtype="float32", spec_toml="[job]\n")


def _through_torch(extra: dict) -> dict:
    buf = io.BytesIO()
    torch.save(extra, buf)   # plain values: checkpoints are read with weights_only=True
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_rl_actor_state_keeps_the_extra_keys_and_round_trips():
    state = RunState(sampler={"epoch": 1, "step": 3}, tracking_run_id="abc", actor_updates=6, critic_updates=6,
                     kl_coef=0.1, rollout_carry={"0": {"active": [], "ready": []}}, rollout_queue=[{"step": 4}],
                     model=FACTS)
    extra = _through_torch(state.to_extra())
    assert set(extra) == {"sampler", "mlflow_run_id", "actor_updates", "critic_updates", "kl_coef", "rollout_carry",
                          "rollout_queue", "hf_config", "model_path", "tokenizer", "dtype", "spec_toml", "role"}
    assert extra["role"] == "actor" and extra["mlflow_run_id"] == "abc" and "trainer" not in extra
    assert RunState.from_extra(extra) == state


def test_sft_and_critic_states():
    sft = RunState(trainer="sft", sampler={"epoch": 0}, tracking_run_id=None, actor_updates=2, model=FACTS, lora={})
    extra = sft.to_extra()
    assert extra["trainer"] == "sft" and extra["lora"] == {} and "rollout_carry" not in extra
    assert RunState.from_extra(extra) == sft
    critic = RunState(role="critic", model=FACTS).to_extra()
    assert critic == {"hf_config": {"model_type": "qwen2"}, "model_path": "builtin:tiny-qwen2", "tokenizer": None,
                      "dtype": "float32", "spec_toml": "[job]\n", "role": "critic"}


def test_an_older_checkpoint_without_optional_keys_reads():
    state = RunState.from_extra({"sampler": {"epoch": 0}, "mlflow_run_id": "x", "actor_updates": 1, "role": "actor"})
    assert state.trainer == "rl" and state.rollout_queue == [] and state.rollout_carry is None and state.kl_coef is None
