"""`mrl launch JOB`: one machine, torchrun with the job's platform.ranks_per_node; a multi-node job
is refused with the sbatch command. The dry runs are fast; the real launch is in the slow tier."""
from __future__ import annotations

import re
import shlex
import subprocess

import pytest

from tests.launch.launch_util import BAD_MESSAGE, BAD_OVERRIDE, JOB, OK_LINE, REPO, launch_env

RANK_LINE = re.compile(r"^\[default(\d+)\]:(.*)$", re.M)  # torchrun --tee 3 (PET_TEE=3)


def mrl_launch(venv, *args: str, command: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / "python"), "-m", "mrl", "launch", *args], cwd=REPO,
                          env=launch_env(venv, command, PET_TEE="3"), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)


def test_dry_run_prints_the_torchrun_command(mrl_venv):
    proc = mrl_launch(mrl_venv, "--dry-run", JOB, "job.description=two words")
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout)
    assert argv[0] == str(mrl_venv / "bin" / "torchrun")
    assert argv[1:] == ["--standalone", "--nnodes", "1", "--nproc_per_node", "2", "-m", "mrl", "train", JOB,
                        "job.description=two words"]
    proc = mrl_launch(mrl_venv, "--dry-run", JOB, "platform.ranks_per_node=1", "parallel.tensor=1",
                      command="preflight")
    assert shlex.split(proc.stdout)[4:9] == ["--nproc_per_node", "1", "-m", "mrl", "preflight"], proc.stdout


def test_multi_node_job_and_bad_spec_are_refused_in_one_line(mrl_venv):
    proc = mrl_launch(mrl_venv, "--dry-run", "jobs/dapo_32b.toml")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ("error: jobs/dapo_32b.toml: platform.nodes = 16; mrl launch runs one machine; launch "
                           "multi-node jobs with: sbatch --nodes 16 --ntasks-per-node 8 launch/slurm.sh "
                           "jobs/dapo_32b.toml\n")
    proc = mrl_launch(mrl_venv, "--dry-run", JOB, BAD_OVERRIDE)
    assert proc.returncode == 2 and BAD_MESSAGE in proc.stderr.splitlines() and "Traceback" not in proc.stderr
    proc = mrl_launch(mrl_venv, "--dry-run", JOB, command="merge")
    assert (proc.returncode, proc.stderr) == (2, "error: MRL_COMMAND merge: mrl launch runs one of train, "
                                                 "sft, preflight, validate\n")


@pytest.mark.slow
def test_launch_runs_one_rank_per_ranks_per_node(mrl_venv):
    proc = mrl_launch(mrl_venv, "--run", "validate", JOB)
    assert proc.returncode == 0, f"mrl launch exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert sorted(int(r) for r, line in RANK_LINE.findall(proc.stdout) if OK_LINE.search(line)) == [0, 1], proc.stdout
