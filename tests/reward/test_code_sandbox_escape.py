"""A program under test cannot reach the run, the host's sockets, the trainer or past its scratch
cap (issue 34, breach 3), wherever the sandbox is started: by the trainer's process, or by a
Landlock-restricted reward worker as `mrl train` runs them (there through the worker's launcher).

Each program reports what it reached as JSON; every case must come back empty:
(a) the run directory, found through /proc/*/cmdline or by its path, with mlflow.db, spec.toml
    and the training parquet in it; (b) a world-writable unix socket on the host, and an
    abstract one; (c) 9 MiB written into a scratch capped at 8 MiB, and writes anywhere else;
    (d) the trainer's /proc/<pid>/environ. `auto` without a mount namespace refuses in one line.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from mrl.reward import code_sandbox
from mrl.reward.code_sandbox import Limits, run_sandboxed

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@pytest.fixture(scope="module")
def host():
    """A run directory with its files where runs usually are (under the working directory, not
    /tmp), a process whose command line names it (as the trainer's does), a world-writable unix
    socket beside it and an abstract one, both listening."""
    (REPO / "runs").mkdir(exist_ok=True)   # git-ignored, where the shipped jobs write their runs
    tmp = Path(tempfile.mkdtemp(prefix="sandbox-escape-", dir=REPO / "runs"))
    os.chmod(tmp, 0o755)
    run = tmp / "outputs" / "job-under-attack"
    run.mkdir(parents=True)
    for name, data in (("mlflow.db", b"SQLite format 3\0"), ("spec.toml", b"[job]\nname = 'x'\n"),
                       ("train.parquet", b"PAR1 every row's tests PAR1")):
        (run / name).write_bytes(data)
        os.chmod(run / name, 0o644)
    for d in (run, run.parent):
        os.chmod(d, 0o755)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", str(run / "spec.toml")])
    path = str(tmp / "host.sock")
    listeners, accepted = [], []
    for address in (path, "\0mrl-test-abstract-" + str(os.getpid())):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(address)
        s.listen(8)
        listeners.append(s)

        def accept(sock=s):
            while True:
                try:
                    accepted.append(sock.accept()[0])
                except OSError:
                    return
        threading.Thread(target=accept, daemon=True).start()
    os.chmod(path, 0o777)
    yield {"run": str(run), "sock": path, "abstract": "\0mrl-test-abstract-" + str(os.getpid()),
           "trainer": os.getpid(), "accepted": accepted}
    holder.kill()
    holder.wait()
    for s in listeners:
        s.close()
    shutil.rmtree(tmp, ignore_errors=True)


ATTACK = r'''
import glob, json, os, socket
H = json.loads({host!r})
found = {{}}
for p in glob.glob("/proc/*/cmdline"):
    try:
        if H["run"].encode() in open(p, "rb").read():
            found.setdefault("cmdline", []).append(p)
    except OSError:
        pass
for name in ("mlflow.db", "spec.toml", "train.parquet"):
    try:
        found[name] = open(os.path.join(H["run"], name), "rb").read(16).hex()
    except OSError:
        pass
for key in ("sock", "abstract"):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(H[key])
        found[key] = "connected"
    except OSError:
        pass
written = 0
try:
    with open("big", "wb") as f:
        for _ in range(9):
            f.write(b"0" * (1 << 20))
            f.flush()
            written += 1
except OSError:
    pass
if written > 8:
    found["scratch"] = written
for where in ("/", "/etc", "/usr", "/var/tmp", "/dev/shm", "/run", os.path.dirname(H["run"])):
    try:
        open(os.path.join(where, "mrl-escape"), "w").write("x")
        found.setdefault("wrote", []).append(where)
    except OSError:
        pass
try:
    found["environ"] = len(open("/proc/%d/environ" % H["trainer"], "rb").read())
except OSError:
    pass
print(json.dumps(found))
'''


def _attack(host) -> str:
    fields = {k: host[k] for k in ("run", "sock", "abstract", "trainer")}
    return ATTACK.format(host=json.dumps(fields))


def _reached(stdout: str) -> dict:
    lines = stdout.strip().splitlines()
    assert lines, stdout
    return json.loads(lines[-1])


def test_unsandboxed_the_attack_reaches_everything(host, tmp_path):
    """The attack program is real: run as a plain process it finds all of it."""
    (tmp_path / "main.py").write_text(_attack(host))
    r = subprocess.run([sys.executable, "main.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    reached = _reached(r.stdout)
    assert {"cmdline", "mlflow.db", "spec.toml", "train.parquet", "sock", "abstract", "scratch", "environ"} <= set(reached)
    for _ in range(600):   # both connections accepted by the listeners' threads, then forgotten
        if len(host["accepted"]) >= 2:
            break
        time.sleep(0.05)
    host["accepted"].clear()


def test_a_program_started_by_the_trainer_reaches_nothing(host):
    r = run_sandboxed({"main.py": _attack(host)}, ["main.py"], b"", Limits(wall_s=20, cpu_s=10, scratch_mb=8,
                                                                             file_size_mb=64))
    assert r.status == "ok", r.stderr_tail
    assert _reached(r.stdout.decode()) == {}
    assert not host["accepted"]


def test_a_program_started_by_a_landlocked_reward_worker_reaches_nothing(host, tmp_path):
    from mrl.reward.pool import Call, RewardPool

    ref = f"{HERE / 'sandbox_programs.py'}:run_program"
    with RewardPool([ref], workers=1, timeout_s=60, protect_dirs=(host["run"], str(tmp_path))) as pool:
        (out,) = pool.run([Call(ref, (_attack(host),), {"scratch_mb": 8})])
    assert out.error is None, out.message
    assert _reached(out.value) == {}
    assert not host["accepted"]


def test_the_worker_launcher_runs_only_mount_namespace_modes():
    from mrl.reward import sandbox_launcher

    sandbox_launcher.start()   # in this test process: a launcher as a worker has one
    try:
        r = sandbox_launcher.run({"main.py": "print(1)"}, ["main.py"], b"", Limits(), "rlimits", b"")
        assert r.status == "sandbox" and b"only mount-namespace isolation" in r.stderr_tail
        r = sandbox_launcher.run({"main.py": "import os; print(os.getpid())"}, ["main.py"], b"", Limits(), "auto", b"")
        assert (r.status, r.stdout) == ("ok", b"2\n")
        assert run_sandboxed({"main.py": "print(3)"}, ["main.py"], b"", Limits()).stdout == b"3\n"   # through it
    finally:
        sandbox_launcher.stop()
    assert code_sandbox.LAUNCHER is None


def test_auto_refuses_in_one_line_where_no_mount_namespace_can_be_had(monkeypatch):
    from mrl.errors import UserError
    from mrl.reward.compose import Rewarder
    from mrl.reward.config import CodeRewardConfig, RewardConfig
    from mrl.reward.sources import reward_sources

    monkeypatch.setattr(code_sandbox, "_MODE", {})
    monkeypatch.setattr(code_sandbox, "_probe", lambda mode: "mount tmpfs on /tmp: Operation not permitted")
    for requested in ("auto", "namespaces"):
        with pytest.raises(code_sandbox.SandboxUnavailable) as e:
            code_sandbox.isolation_mode(requested)
        said = str(e.value)
        assert "\n" not in said and "no sandbox with a mount namespace here" in said and "Operation not permitted" in said
    with pytest.raises(UserError) as e:
        Rewarder(reward_sources(RewardConfig(builtin="code", workers=1, code=CodeRewardConfig())), workers=1)
    assert "untrusted programs are not run" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(code_sandbox.SandboxUnavailable):   # a direct call is refused too: never a weaker mode
        run_sandboxed({"main.py": "print(1)"}, ["main.py"], b"", Limits(), "auto")
    assert code_sandbox.isolation_mode("rlimits") == "rlimits"   # the unsafe mode only when named


USER_NS_RUNNER = """
import json, sys
sys.path.insert(0, {repo!r})
from mrl.reward.code_sandbox import Limits, isolation_mode, run_sandboxed
program = open({program!r}).read()
r = run_sandboxed({{"main.py": program}}, ["main.py"], b"", Limits(wall_s=20, cpu_s=10, scratch_mb=8, file_size_mb=64))
print(json.dumps({{"mode": isolation_mode(), "status": r.status, "stdout": r.stdout.decode(),
                  "stderr": r.stderr_tail.decode()}}))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists("/usr/bin/python3"),
                    reason="runs the sandbox as another, unprivileged user (needs root to switch, setpriv, a system python)")
def test_user_namespace_mode_of_an_unprivileged_user_reaches_nothing(host):
    where = Path(host["run"]).parent
    (where / "attack.py").write_text(_attack(host))
    (where / "runner.py").write_text(USER_NS_RUNNER.format(repo=str(REPO), program=str(where / "attack.py")))
    for f in ("attack.py", "runner.py"):
        os.chmod(where / f, 0o644)
    r = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "/usr/bin/python3",
                        str(where / "runner.py")], cwd="/", capture_output=True, text=True, timeout=120)
    if r.returncode != 0 and "SandboxUnavailable" in r.stderr:
        pytest.skip("no unprivileged user namespaces here")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert (got["mode"], got["status"]) == ("user-namespace", "ok"), got
    assert _reached(got["stdout"]) == {}
    assert not host["accepted"]
