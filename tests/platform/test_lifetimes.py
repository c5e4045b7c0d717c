"""Ranks die with their launcher (`mrl.platform.lifetime.die_with_launcher`).

Fast: a process armed as a rank (TORCHELASTIC_RUN_ID set) whose parent is SIGKILLed gets SIGTERM
and is gone; one that ignores SIGTERM (a rank stuck in a collective) is SIGKILLed after the grace
period; one whose launcher died before it could arm (its parent is not `MRL_LAUNCHER_PID`) exits
at once. Slow: `mrl launch` of the quickstart is SIGKILLed while both ranks run; both ranks end.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli.test_cli import ENV, REPO

RANK = """
import os, signal, sys, time
from mrl.platform.lifetime import die_with_launcher
armed = die_with_launcher(grace_s={grace})
if {ignore_term}:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(os.getpid(), armed, flush=True)
time.sleep(600)
"""

MIDDLE = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
line = child.stdout.readline().strip()
print(line if line else f"exited {child.wait()}", flush=True)
time.sleep(600)
"""


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"   # a zombie waiting for init to reap it
    except FileNotFoundError:
        return True


def wait_gone(pids, limit_s: float = 60.0) -> list[int]:
    """The pids still alive after up to `limit_s` (a bound for the test, not a timing claim)."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end and not all(gone(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if not gone(p)]


def _rank_under_a_launcher(tmp_path, *, grace: float, ignore_term: bool, env_extra=None):
    env = {**ENV, "TORCHELASTIC_RUN_ID": "test", **(env_extra or {})}
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE, RANK.format(grace=grace, ignore_term=ignore_term)],
                              stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    line = middle.stdout.readline().split()
    return middle, line


@pytest.mark.parametrize("ignore_term", [False, True])
def test_a_rank_dies_with_its_launcher(tmp_path, ignore_term):
    middle, (pid, armed) = _rank_under_a_launcher(tmp_path, grace=1.0, ignore_term=ignore_term)
    pid = int(pid)
    try:
        assert armed == "True"
        assert not gone(pid)
        middle.kill()       # SIGKILL: the launcher runs no cleanup
        middle.wait()
        assert wait_gone([pid]) == []
    finally:
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_rank_whose_launcher_is_already_gone_exits_at_once(tmp_path):
    middle, line = _rank_under_a_launcher(tmp_path, grace=1.0, ignore_term=False,
                                          env_extra={"MRL_LAUNCHER_PID": "1"})
    try:
        assert line == ["exited", "143"]   # at once, as on SIGTERM: its parent is not the launcher it was started by
    finally:
        middle.kill()
        middle.wait()


def test_what_a_rank_starts_is_not_a_rank():
    """A rank's own `python -m mrl merge` (the HF export) inherits torchrun's variables; it must
    neither exit nor tie itself to the rank."""
    script = ("import os, subprocess, sys\n"
              "from mrl.platform.lifetime import die_with_launcher\n"
              "print(die_with_launcher(grace_s=1.0), os.environ['MRL_LAUNCHER_PID'])\n"
              "child = subprocess.run([sys.executable, '-c', 'from mrl.platform.lifetime import die_with_launcher; "
              "print(die_with_launcher())'], capture_output=True, text=True)\n"
              "print(child.returncode, child.stdout.strip())\n")
    rank = subprocess.run([sys.executable, "-c", script], env={**ENV, "TORCHELASTIC_RUN_ID": "test",
                                                               "MRL_LAUNCHER_PID": str(os.getpid())},
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert rank.stdout.split("\n")[:2] == ["True 0", "0 False"], rank.stdout + rank.stderr


def test_outside_a_launcher_nothing_is_armed():
    r = subprocess.run([sys.executable, "-c", "from mrl.platform.lifetime import die_with_launcher; "
                        "print(die_with_launcher())"], env={k: v for k, v in ENV.items()
                                                           if k not in ("TORCHELASTIC_RUN_ID", "MRL_LAUNCHER_PID")},
                       capture_output=True, text=True, cwd=REPO)
    assert r.stdout.strip() == "False", r.stderr


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


@pytest.mark.slow
def test_sigkill_of_mrl_launch_ends_both_ranks(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-m", "mrl", "launch", "jobs/quickstart_cpu.toml",
                                 f"job.output_dir={tmp_path}", "job.name=run", "trainer.total_steps=1000"],
                                cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks: list[int] = []
    try:
        lock = tmp_path / "run" / ".mrl.lock"
        end = time.monotonic() + 300
        while time.monotonic() < end and not (lock.exists() and '"pid"' in lock.read_text()):
            assert launcher.poll() is None, "mrl launch ended before the ranks started training"
            time.sleep(0.5)
        ranks = _children(launcher.pid)
        assert len(ranks) == 2, ranks
        launcher.kill()
        launcher.wait()
        assert wait_gone(ranks, 120) == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in ranks:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
