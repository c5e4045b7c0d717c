"""`sbatch launch/slurm.sh` on a real Slurm cluster (one node is enough).

`.ci/slurm-setup.sh` (as root) starts a one-node cluster on this machine; CI runs it before
`make test`. Without a cluster the tests skip, or fail when MRL_REQUIRE_SLURM=1.

Every job is submitted with `sbatch --wait` and a unique name, a Slurm time limit and a
subprocess timeout; a job still there on timeout (or at the end of the module) is cancelled.
`--gpus-per-node=0` overrides the script's `#SBATCH --gpus-per-node=8` (the test node has no
GPUs). SLURM_LABELIO=1 is srun's `--label`: every rank's line starts with `<task id>: `, so the
output shows which ranks ran, and that a refused job never reached srun.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from tests.launch.launch_util import BAD_MESSAGE, BAD_OVERRIDE, JOB, OK_LINE, REPO, find_venv, launch_env

pytestmark = pytest.mark.slow

JOB_TIMEOUT = 150      # s per job; measured 2-16 s for validate, 12 s for preflight (2 cores)
SLURM_TIME_LIMIT = 5   # min; Slurm kills the job itself even if this process dies
TRAIN_TIMEOUT = 480    # s for the 2-step training job; measured 80 s on a loaded 2-core machine
NAME_PREFIX = f"mrl-test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
RANK_LINE = re.compile(r"^\s*(\d+): (.*)$", re.M)
USABLE_STATES = {"idle", "mix", "alloc", "comp"}
# Rank 0's summary line when `mrl preflight` passed on every rank; "via slurm, world 2" shows the
# platform layer took its rank and world size from srun's variables.
RUN_NAME = "quickstart-cpu"  # job.name of JOB: its run directory is <job.output_dir>/quickstart-cpu
PREFLIGHT_OK = re.compile(r"^preflight ok: quickstart-cpu: cpu/gloo via slurm, world 2 = DP 1 x TP 2 x PP 1 x CP 1; ")

_names: list[str] = []


@cache  # asked once per session: a down controller takes seconds to answer
def _cluster_problem() -> str | None:
    """Why no job can run here, or None when a node with 2 CPUs is up."""
    if shutil.which("sbatch") is None:
        return "sbatch is not on PATH"
    try:
        proc = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%N %t %c"], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"sinfo failed: {e}"
    if proc.returncode != 0:
        return f"the Slurm controller does not answer: {proc.stderr.strip()}"
    nodes = [line.split() for line in proc.stdout.splitlines() if line.strip()]
    if not any(len(n) == 3 and n[1] in USABLE_STATES and n[2].isdigit() and int(n[2]) >= 2 for n in nodes):
        return f"no node with 2 CPUs is up (sinfo: {proc.stdout.strip() or 'no nodes'!r})"
    return None


def _scancel(name: str) -> None:
    try:
        subprocess.run(["scancel", f"--name={name}"], stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pass  # best effort; the job's own --time limit still ends it


@pytest.fixture(scope="module")
def cluster():
    problem = _cluster_problem()
    if problem:
        message = f"no Slurm cluster: {problem}; start one with `bash .ci/slurm-setup.sh` (root)"
        if os.environ.get("MRL_REQUIRE_SLURM") == "1":
            pytest.fail(message + " [MRL_REQUIRE_SLURM=1]")
        pytest.skip(message)
    yield
    for name in _names:  # nothing should be left; make sure of it
        _scancel(name)


@pytest.fixture(scope="module")
def venv(cluster) -> Path:
    return find_venv()


@dataclass
class Job:
    rc: int
    job_id: str | None  # from sbatch's "Submitted batch job N"
    output: str        # the job's output file: the script's stdout and stderr, then srun's
    sbatch_err: str
    seconds: float

    def ranks(self, pattern: re.Pattern) -> list[int]:
        """Task ids whose labelled lines match pattern."""
        return sorted(int(t) for t, line in RANK_LINE.findall(self.output) if pattern.search(line))

    def __str__(self) -> str:
        return f"sbatch exit {self.rc} after {self.seconds:.0f}s\n--- job output\n{self.output}--- sbatch stderr\n{self.sbatch_err}"


def sbatch(venv: Path, out_dir: Path, options: list[str], job_args: list[str], *, command: str | None = "validate",
           no_gpus: bool = True, timeout: float = JOB_TIMEOUT, time_limit_min: int = SLURM_TIME_LIMIT) -> Job:
    """`sbatch --wait [options] launch/slurm.sh job_args` from the repo root, as a user would run it."""
    name = f"{NAME_PREFIX}-{len(_names)}"
    _names.append(name)
    out = out_dir / f"{name}.out"
    cmd = ["sbatch", "--wait", f"--job-name={name}", f"--output={out}", f"--time={time_limit_min}",
           *(["--gpus-per-node=0"] if no_gpus else []), *options, "launch/slurm.sh", *job_args]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=launch_env(venv, command, SLURM_LABELIO="1"),
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        _scancel(name)
        try:
            queue = subprocess.run(["squeue", f"--name={name}"], stdin=subprocess.DEVNULL, capture_output=True,
                                   text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired) as e:
            queue = f"(squeue failed: {e})\n"
        pytest.fail(f"{shlex.join(cmd)} did not finish in {timeout:.0f}s; cancelled it\n--- squeue\n{queue}"
                    f"--- job output\n{out.read_text() if out.exists() else '(none)'}")
    submitted = re.search(r"Submitted batch job (\d+)", proc.stdout)
    job = Job(proc.returncode, submitted and submitted.group(1), out.read_text() if out.exists() else "",
              proc.stderr, time.monotonic() - start)
    # `sbatch --wait` exits 0 when the job record was purged before it looked: never trust that.
    assert "no longer found" not in proc.stderr, str(job)
    return job


def run_log(tmp_path: Path, job: Job) -> Path:
    """Where launch/slurm.sh copies the job's output: `<job.output_dir>/<job.name>/slurm-<jobid>.out`."""
    assert job.job_id, f"no job id in sbatch's output\n{job}"
    return tmp_path / RUN_NAME / f"slurm-{job.job_id}.out"


def test_two_ranks_run_under_srun_and_log_into_the_run_directory(venv, tmp_path):
    job = sbatch(venv, tmp_path, ["--nodes", "1", "--ntasks-per-node", "2"], [JOB, f"job.output_dir={tmp_path}"])
    assert job.rc == 0, str(job)
    assert job.ranks(OK_LINE) == [0, 1], str(job)
    log = run_log(tmp_path, job)
    assert log.is_file(), f"no {log}\n{job}"
    text = log.read_text()
    # The pre-launch validation line, then the same rank lines as Slurm's own output file.
    assert text.startswith("ok: jobs/quickstart_cpu.toml: world 2 = "), text
    assert sorted(int(t) for t, line in RANK_LINE.findall(text) if OK_LINE.search(line)) == [0, 1], text
    assert text.splitlines()[-2:] == job.output.splitlines()[-2:], f"{text}\n{job}"


def test_mismatched_allocation_fails_before_srun_with_the_resubmit_command(venv, tmp_path):
    args = [JOB, f"job.output_dir={tmp_path}", "job.description=two words"]
    job = sbatch(venv, tmp_path, ["--nodes", "1", "--ntasks-per-node", "1"], args)
    assert job.rc == 2, str(job)
    assert "wants platform.nodes 1 x platform.ranks_per_node 2 = 2 ranks" in job.output, str(job)
    assert "this allocation has 1 node(s) and 1 task(s)" in job.output, str(job)
    resubmit = ("sbatch --nodes 1 --ntasks-per-node 2 --gpus-per-node 0 launch/slurm.sh "
                f"jobs/quickstart_cpu.toml job.output_dir={tmp_path} job.description=two\\ words")
    assert f"Submit with: {resubmit}\n" in job.output, str(job)
    assert not RANK_LINE.search(job.output), f"srun ran\n{job}"
    assert not (tmp_path / RUN_NAME).exists(), "a refused job created its run directory"
    # The suggested command, pasted as is, runs the job.
    argv = shlex.split(resubmit)
    at = argv.index("launch/slurm.sh")
    again = sbatch(venv, tmp_path, argv[1:at], argv[at + 1:], no_gpus=False)
    assert again.rc == 0, str(again)
    assert again.ranks(OK_LINE) == [0, 1], str(again)


def test_bad_spec_fails_before_srun_with_the_validator_message(venv, tmp_path):
    job = sbatch(venv, tmp_path, ["--nodes", "1", "--ntasks-per-node", "2"],
                 [JOB, f"job.output_dir={tmp_path}", BAD_OVERRIDE])
    assert job.rc == 2, str(job)
    assert BAD_MESSAGE in job.output.splitlines(), str(job)
    assert job.output.count("unknown key") == 1, f"the spec was checked more than once\n{job}"
    assert "Traceback" not in job.output, str(job)
    assert not RANK_LINE.search(job.output), f"srun ran\n{job}"
    assert not (tmp_path / RUN_NAME).exists(), "a refused job created its run directory"


def _preflight_available(venv: Path) -> bool:
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "mrl", "preflight", "--help"], cwd=REPO,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    return proc.returncode == 0


def test_preflight_on_two_ranks_under_srun(venv, tmp_path):
    if not _preflight_available(venv):
        pytest.skip("mrl preflight not available")
    # A rendezvous that cannot complete fails in 60 s with mrl's message instead of the 300 s default.
    job = sbatch(venv, tmp_path, ["--nodes", "1", "--ntasks-per-node", "2"], [JOB, f"job.output_dir={tmp_path}", "platform.init_timeout_s=60"],
                 command="preflight")
    assert job.rc == 0, str(job)
    assert job.ranks(PREFLIGHT_OK) == [0], f"no preflight success line from rank 0\n{job}"


def test_training_job_checkpoints_and_logs_metrics(venv, tmp_path):
    """The acceptance run: `sbatch launch/slurm.sh` with the default command (train) on 2 ranks."""
    job = sbatch(venv, tmp_path, ["--nodes", "1", "--ntasks-per-node", "2"],
                 [JOB, "trainer.total_steps=2", f"job.output_dir={tmp_path}"], command=None,
                 timeout=TRAIN_TIMEOUT, time_limit_min=TRAIN_TIMEOUT // 60 + 1)
    assert job.rc == 0, str(job)
    assert job.ranks(re.compile(r"^step 2/2 ")) == [0], f"no last-step line from rank 0\n{job}"
    run_dir = tmp_path / RUN_NAME
    assert run_log(tmp_path, job).is_file(), f"no job log in {run_dir}\n{job}"
    # Checkpoint: `latest` names the last step's directory (the final step is saved even off every_steps).
    latest = run_dir / "checkpoints" / "actor" / "latest"
    assert latest.is_file(), f"no {latest}\n{job}"
    assert latest.read_text().strip() == "step_00000002"
    assert (latest.parent / "step_00000002" / "metadata.json").is_file()
    # Metrics: one MLflow run in the output directory's shared sqlite store, reward/mean at steps 1 and 2.
    from mlflow.tracking import MlflowClient

    db = run_dir.parent / "mlflow.db"
    assert db.is_file(), f"no {db}\n{job}"
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [(r.info.run_name, r.info.status) for r in runs] == [(RUN_NAME, "FINISHED")]
    rewards = client.get_metric_history(runs[0].info.run_id, "reward/mean")
    assert sorted(m.step for m in rewards) == [1, 2]
    assert all(0.0 <= m.value <= 1.0 for m in rewards)
