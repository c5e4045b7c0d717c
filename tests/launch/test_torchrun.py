"""`launch/torchrun.sh` for real: a one-node job starts one rank per `platform.ranks_per_node`;
a bad spec or a multi-node job is refused before any rank starts. No Slurm needed."""
from __future__ import annotations

import re
import subprocess

import pytest

from tests.launch.launch_util import BAD_MESSAGE, BAD_OVERRIDE, JOB, OK_LINE, REPO, launch_env

pytestmark = pytest.mark.slow

TIMEOUT = 180  # s; a 2-rank validate run takes about 15 s on 2 cores
# PET_TEE=3 is torchrun's `--tee 3` (every torchrun flag reads PET_<FLAG>): it prefixes each
# rank's lines with `[default<local rank>]:`, so the output shows which ranks ran.
RANK_LINE = re.compile(r"^\[default(\d+)\]:(.*)$", re.M)


def torchrun_sh(venv, *args: str, command: str = "validate", cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO / "launch/torchrun.sh"), *args], cwd=cwd,
                          env=launch_env(venv, command, PET_TEE="3"), stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=TIMEOUT)


def ranks_printing(stdout: str, pattern: re.Pattern) -> list[int]:
    return sorted(int(rank) for rank, line in RANK_LINE.findall(stdout) if pattern.search(line))


def test_one_node_job_runs_one_rank_per_ranks_per_node(mrl_venv, tmp_path):
    # from another directory, the job path relative to it (tmp/jobs -> the repository's jobs/)
    (tmp_path / "jobs").symlink_to(REPO / "jobs")
    proc = torchrun_sh(mrl_venv, JOB, cwd=tmp_path)
    assert proc.returncode == 0, f"torchrun.sh exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert ranks_printing(proc.stdout, OK_LINE) == [0, 1], proc.stdout
    # The pre-launch validation is silent on success: the only ok lines come from the ranks.
    assert len(re.findall(r"ok: ", proc.stdout)) == 2, proc.stdout


def test_multi_node_job_is_refused_with_the_sbatch_command(mrl_venv):
    proc = torchrun_sh(mrl_venv, "jobs/dapo_32b.toml", "job.description=two words")
    assert proc.returncode == 2, f"torchrun.sh exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert ("error: jobs/dapo_32b.toml: platform.nodes = 16; launch multi-node jobs with: "
            "sbatch --nodes 16 --ntasks-per-node 8 launch/slurm.sh jobs/dapo_32b.toml job.description=two\\ words"
            ) in proc.stderr
    assert not RANK_LINE.search(proc.stdout + proc.stderr), "a rank started"


def test_bad_spec_fails_before_any_rank_starts(mrl_venv):
    proc = torchrun_sh(mrl_venv, JOB, BAD_OVERRIDE)
    assert proc.returncode == 2, f"torchrun.sh exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert BAD_MESSAGE in proc.stderr.splitlines()
    assert "Traceback" not in proc.stderr
    assert not RANK_LINE.search(proc.stdout + proc.stderr), "a rank started"
