"""Values that parse but cannot run are refused by `mrl validate`, one line each naming the key."""
from __future__ import annotations

from pathlib import Path

import pytest

from mrl.config.loader import load
from mrl.errors import SpecError

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "jobs/quickstart_cpu.toml"


@pytest.mark.parametrize("override,line", [
    ("actor.optim.lr=inf", "actor.optim.lr: must be a finite number, got inf"),
    ("actor.optim.lr=nan", "actor.optim.lr: must be a finite number, got nan"),
    ("rollout.temperature=-inf", "rollout.temperature: must be a finite number, got -inf"),
    ("trainer.total_steps=1180591620717411303424", "trainer.total_steps: must be <= 2147483647, got 1180591620717411303424"),
    ("checkpoint.every_steps=4294967296", "checkpoint.every_steps: must be <= 2147483647, got 4294967296"),
    ("data.seed=-5", "data.seed: must be >= 0, got -5"),
    ("job.seed=18446744073709551616", "job.seed: must be <= 4294967295, got 18446744073709551616"),
    ("rollout.seed=4294967296", "rollout.seed: must be <= 4294967295, got 4294967296"),
    ("tracking.tracking_uri=bogus://x", "tracking.tracking_uri: scheme 'bogus' is not an MLflow store (sqlite, file, "
                                        "http, https, databricks, postgresql, mysql, mssql, or a local directory)"),
    ("rollout.stop_token_ids=7,600,512", "rollout.stop_token_ids: 600, 512 outside the vocabulary of 512 tokens"),
    ("rollout.stop_token_ids=-1", "rollout.stop_token_ids: element 0: must be >= 0, got -1"),
    ("job.name=../../x", "job.name: '../../x' is not a plain name"),
    ("job.name=/tmp/x", "job.name: '/tmp/x' is not a plain name"),
    ("job.name=..", "job.name: '..' is not a plain name"),
])
def test_value_is_refused_in_one_line(override, line):
    with pytest.raises(SpecError) as e:
        load(JOB, [override])
    assert len(e.value.problems) == 1 and f"command line: {line}" in e.value.problems[0], e.value.problems


@pytest.mark.parametrize("override", ["tracking.tracking_uri=sqlite:////tmp/x.db", "tracking.tracking_uri=http://h:5000",
                                      "tracking.tracking_uri=postgresql+psycopg2://u@h/db", "tracking.tracking_uri=/tmp/mlruns",
                                      "job.seed=4294967295", "job.name=run 7", "rollout.stop_token_ids=511"])
def test_values_at_the_edge_are_accepted(override):
    load(JOB, [override])


def test_a_job_file_that_is_not_utf8_is_one_line(tmp_path, cli):
    bad = tmp_path / "latin1.toml"
    data = f'extends = "{JOB}"\n[job]\ndescription = "caf\xe9"\n'.encode("latin-1")
    bad.write_bytes(data)
    rc, _, err = cli("validate", bad)
    assert rc == 2 and err.splitlines()[0] == (f"error: {bad}: not UTF-8 text (byte {data.index(0xE9)}: b'\\xe9'); "
                                               "save the job file as UTF-8"), err
    assert "Traceback" not in err


def test_a_reward_file_that_is_not_utf8_is_one_line(tmp_path, cli):
    reward = tmp_path / "rw.py"
    reward.write_bytes(b"# caf\xe9\ndef score(p, r, g, e):\n    return 1.0\n")
    job = tmp_path / "job.toml"
    job.write_text(f'extends = "{JOB}"\n[reward]\nfunction = "rw.py:score"\n')
    rc, _, err = cli("validate", job)
    assert rc == 2 and f"reward.function: {reward} is not UTF-8 text (byte 5)" in err and "Traceback" not in err
