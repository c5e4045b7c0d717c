"""A minimal job (model, data, reward; everything else default) is valid: the defaults form a job.

`rollout.responses_per_prompt` is derived once, in `mrl.config.defaults.resolve`: a group of
`GROUP_RESPONSES` for an estimator that compares the responses of a prompt's group (GRPO's
default advantage among them), one response otherwise; a value the job sets is kept.
"""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mrl.config.loader import load
from mrl.config.defaults import GROUP_RESPONSES, resolve


@pytest.fixture
def minimal(tmp_path):
    """A job file naming only model.path, data.train_files and a reward (as a new user writes it)."""
    pq.write_table(pa.table({"prompt": ["1 + 1 =", "2 + 3 ="], "answer": ["2", "5"]}), tmp_path / "train.parquet")
    job = tmp_path / "job.toml"
    job.write_text('[model]\npath = "builtin:tiny-qwen2"\n\n[data]\ntrain_files = ["train.parquet"]\n\n'
                   '[reward]\nbuiltin = "exact_match"\n')
    return job


def test_a_minimal_grpo_job_validates(minimal, cli):
    rc, out, err = cli("validate", minimal)
    assert rc == 0, err
    assert f"8 prompts x {GROUP_RESPONSES} = {8 * GROUP_RESPONSES} responses/step" in out and "grpo/" in out, out


def test_responses_per_prompt_follows_the_estimator(minimal):
    def responses(*overrides):
        spec, _ = load(minimal, list(overrides))   # load resolves
        assert resolve(spec) == spec               # once: resolving again changes nothing
        return spec.rollout.responses_per_prompt

    assert GROUP_RESPONSES >= 2
    assert responses() == GROUP_RESPONSES                                   # grpo, the default advantage
    assert responses("algorithm.advantage=rloo") == GROUP_RESPONSES
    assert responses("algorithm.advantage=reinforce_pp") == 1
    assert responses("algorithm.advantage=gae", "critic.enable=true") == 1
    assert responses("rollout.responses_per_prompt=3") == 3


def test_a_single_response_grpo_job_is_still_refused(minimal, cli):
    rc, _, err = cli("validate", minimal, "rollout.responses_per_prompt=1")
    assert rc == 2 and "needs >= 2 responses per prompt, got 1" in err, err
