"""Files a run shares with others: its lock files, and a checkpoint directory two jobs were given.

- `.mrl.lock` is never followed through a symlink (a link to a file outside the run would be
  overwritten, then truncated) and must be a regular file; either is refused in one line.
- The checkpoint directory has a lock of its own: a second job given the same `checkpoint.dir`
  (another `job.output_dir`) is refused in one line naming the holder.
- Each manifest names the job that saved it: retention deletes only its own job's saves, and a
  job refuses a checkpoint directory holding another job's checkpoints (so it never continues
  that job's checkpoint or MLflow run), in one line.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mrl.checkpoint import manifest, store
from mrl.checkpoint.lock import LOCK_FILE, RunLock, agree_on_lock
from mrl.checkpoint.run_state import job_identity, refuse_foreign, resume_run
from mrl.errors import UserError

JOB_A = {"name": "a", "run_dir": "/runs/a"}
JOB_B = {"name": "b", "run_dir": "/runs/b"}


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    return text


# ----------------------------------------------------------------------------- the lock file itself

@pytest.mark.parametrize("kind", ["symlink_to_file", "symlink_dangling", "symlink_to_dir", "fifo", "directory"])
def test_a_lock_file_that_is_not_a_regular_file_is_refused(tmp_path, kind):
    run, outside = tmp_path / "run", tmp_path / "outside.txt"
    run.mkdir()
    outside.write_text("precious\n")
    lock = run / LOCK_FILE
    if kind == "symlink_to_file":
        os.symlink(outside, lock)
    elif kind == "symlink_dangling":
        os.symlink(tmp_path / "created_by_the_lock", lock)
    elif kind == "symlink_to_dir":
        os.symlink(tmp_path, lock)
    elif kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.mkdir()
    with pytest.raises(UserError) as e:
        RunLock(run).acquire()
    said = _one_line(e)
    assert said.startswith("job.output_dir: ") and str(lock) in said
    if kind.startswith("symlink"):
        assert "is a symlink" in said
    assert outside.read_text() == "precious\n"
    assert not (tmp_path / "created_by_the_lock").exists()


def test_a_regular_lock_file_still_locks(tmp_path):
    (tmp_path / LOCK_FILE).write_text("")
    lock = RunLock(tmp_path).acquire()
    assert lock.held and '"pid"' in (tmp_path / LOCK_FILE).read_text()
    lock.release()


# ----------------------------------------------------------------------------- one checkpoint.dir, two jobs

_HOLD = """
import sys, time
from mrl.checkpoint.lock import agree_on_lock
held = agree_on_lock(sys.argv[1], rank=0, world_size=1, checkpoint_dir=sys.argv[2])
print("held", flush=True)
time.sleep(120)
"""


def test_a_second_job_sharing_the_checkpoint_dir_is_refused_naming_the_holder(tmp_path):
    shared = tmp_path / "shared_ckpt"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path / "run_a"), str(shared)],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError) as e:
            agree_on_lock(tmp_path / "run_b", rank=0, world_size=1, checkpoint_dir=shared)
        said = _one_line(e)
        assert said.startswith(f"checkpoint.dir: the checkpoint directory {shared} is in use by pid {holder.pid}")
        assert "own checkpoint.dir" in said
        # the refused job released the run-directory lock it took on the way
        assert RunLock(tmp_path / "run_b").acquire().held
    finally:
        holder.kill()
        holder.wait()


def test_the_checkpoint_dir_inside_the_run_dir_is_locked_once(tmp_path):
    locks = agree_on_lock(tmp_path / "run", rank=0, world_size=1, checkpoint_dir=tmp_path / "run" / "checkpoints")
    assert [lk.key for lk in locks.locks] == ["job.output_dir", "checkpoint.dir"]
    locks.release()
    same = agree_on_lock(tmp_path / "run", rank=0, world_size=1, checkpoint_dir=tmp_path / "run")
    assert [lk.key for lk in same.locks] == ["job.output_dir"]
    same.release()


# ----------------------------------------------------------------------------- whose checkpoint it is

def _fake_checkpoint(root: Path, step: int, job) -> Path:
    d = root / store.step_name(step)
    d.mkdir(parents=True)
    (d / "common.pt").write_bytes(b"x")
    manifest.write(d, {"common.pt": manifest.file_entry(d / "common.pt")}, step=step, optimizer=False, job=job)
    store.write_latest(root, d.name)
    return d


def test_retention_deletes_only_its_own_jobs_saves(tmp_path):
    root = tmp_path / "actor"
    a = [_fake_checkpoint(root, s, JOB_A) for s in (1, 2, 3)]
    old = _fake_checkpoint(root, 4, None)   # an older mrl's save: no job recorded
    b = [_fake_checkpoint(root, s, JOB_B) for s in (5, 6, 7)]
    removed = store.prune(root, 1, owner=JOB_B)
    assert removed == b[:2]
    assert all(p.is_dir() for p in (*a, old, b[2]))
    assert manifest.job_of(a[0]) == JOB_A and manifest.job_of(old) is None


def test_a_job_refuses_a_checkpoint_dir_holding_another_jobs_checkpoint(tmp_path):
    _fake_checkpoint(tmp_path / "actor", 3, JOB_A)
    refuse_foreign(tmp_path, JOB_A)                       # its own: fine
    with pytest.raises(UserError) as e:
        refuse_foreign(tmp_path, JOB_B)
    said = _one_line(e)
    assert said.startswith(f"checkpoint.dir: {tmp_path / 'actor' / 'step_00000003'} was saved by job 'a'")
    assert "not by this job 'b'" in said and "checkpoint.load_from" in said
    # a companion's directory counts too
    _fake_checkpoint(tmp_path / "critic", 3, JOB_A)
    with pytest.raises(UserError, match="critic"):
        refuse_foreign(tmp_path, JOB_B, ("critic",))


@pytest.mark.parametrize("resume", ["auto", "never", "must"])
def test_resume_of_any_kind_refuses_before_loading(tmp_path, resume):
    """Whatever `checkpoint.resume` says, nothing is loaded from, saved over or pruned in a
    directory of another job (a fresh start there would prune and replace its saves)."""
    _fake_checkpoint(tmp_path / "actor", 3, JOB_A)
    checkpoint = SimpleNamespace(load_from=None, resume=resume)
    with pytest.raises(UserError, match="was saved by job 'a'"):
        resume_run(tmp_path, engine=None, checkpoint=checkpoint, job=JOB_B)


def test_job_identity_is_the_name_and_the_absolute_run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = SimpleNamespace(job=SimpleNamespace(name="gsm8k", output_dir="runs"))
    assert job_identity(spec) == {"name": "gsm8k", "run_dir": str(tmp_path / "runs" / "gsm8k")}


@pytest.mark.slow
def test_a_job_resumes_its_own_checkpoint_and_another_job_is_refused_it(tmp_path):
    """`mrl train` end to end: job `a` saves (its manifest names it) and resumes its own
    checkpoint; job `b` given the same checkpoint.dir stops at start in one line, touching
    nothing."""
    from tests.cli.test_cli import ENV, REPO

    shared = tmp_path / "shared_ckpt"

    def train(name: str, steps: int):
        return subprocess.run([sys.executable, "-m", "mrl", "train", "jobs/quickstart_cpu.toml",
                               "platform.ranks_per_node=1", "parallel.tensor=1", f"job.output_dir={tmp_path}",
                               f"job.name={name}", f"trainer.total_steps={steps}", "checkpoint.every_steps=1",
                               f"checkpoint.dir={shared}"], cwd=REPO, env=ENV, capture_output=True, text=True,
                              timeout=900)

    first = train("a", 1)
    assert first.returncode == 0, first.stderr[-3000:]
    saved = store.latest(shared / "actor")
    assert manifest.job_of(saved) == {"name": "a", "run_dir": str((tmp_path / "a").resolve())}
    again = train("a", 2)
    assert again.returncode == 0 and "resumed" in (again.stdout + again.stderr).lower(), again.stderr[-3000:]
    assert [p.name for p in store.checkpoints(shared / "actor")] == ["step_00000002"]
    other = train("b", 2)
    errors = [line for line in other.stderr.splitlines() if line.startswith("error: ")]
    assert other.returncode == 2 and len(errors) == 1 and "was saved by job 'a'" in errors[0], other.stderr[-3000:]
    assert [p.name for p in store.checkpoints(shared / "actor")] == ["step_00000002"]
    assert manifest.job_of(store.latest(shared / "actor"))["name"] == "a"
