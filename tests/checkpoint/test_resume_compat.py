"""Before a resume loads a tensor: another model is one line naming each difference; a changed
reward file is one warning."""
from pathlib import Path

import pytest

from mrl.checkpoint.compat import check_resume, model_differences, reward_file_hashes
from mrl.errors import UserError

DENSE = {"model_type": "qwen2", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": True}


def test_model_differences_in_words():
    assert model_differences(DENSE, dict(DENSE)) == []
    assert model_differences(DENSE, {**DENSE, "hidden_size": 64}) == ["hidden_size 128 (checkpoint) vs 64 (job)"]
    assert model_differences(DENSE, {**DENSE, "tie_word_embeddings": False}) == [
        "embeddings tied (checkpoint) vs untied (job)"]
    assert model_differences(DENSE, {**DENSE, "model_type": "qwen3_moe", "num_experts": 4}) == [
        "dense (checkpoint) vs MoE (4 experts) (job)", "model_type qwen2 (checkpoint) vs qwen3_moe (job)"]


def test_another_model_is_one_line_and_a_changed_reward_a_warning(tmp_path):
    ckpt = tmp_path / "step_00000003"
    with pytest.raises(UserError) as e:
        check_resume(ckpt, {"hf_config": DENSE}, job_hf={**DENSE, "hidden_size": 64, "tie_word_embeddings": False},
                     reward_files={})
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"checkpoint {ckpt} holds another model than the job's: ")
    assert "hidden_size 128 (checkpoint) vs 64 (job)" in msg and "embeddings tied (checkpoint) vs untied" in msg
    reward = tmp_path / "r.py"
    reward.write_text("def score(p, r, g, e):\n    return 1.0\n")
    saved = reward_file_hashes([f"{reward}:score", "mrl.reward.builtins:gsm8k"])
    assert list(saved) == [str(reward.resolve())]
    said = []
    check_resume(ckpt, {"hf_config": DENSE, "reward_files": saved}, job_hf=DENSE,
                 reward_files=reward_file_hashes([f"{reward}:score"]), warn=said.append)
    assert said == []
    reward.write_text("def score(p, r, g, e):\n    return 0.0\n")
    check_resume(ckpt, {"hf_config": DENSE, "reward_files": saved}, job_hf=DENSE,
                 reward_files=reward_file_hashes([f"{reward}:score"]), warn=said.append)
    assert len(said) == 1 and str(reward.resolve()) in said[0] and "changed since checkpoint step_00000003" in said[0]
