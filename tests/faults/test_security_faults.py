"""Fault battery, hostile inputs: crafted checkpoints, `latest` pointers out of the root, reward
functions reaching for secrets / the run directory / the trainer, and `extends` at special files.

Each case is tried as a careless or hostile user would and classed: handled (refused or contained,
said in one line), silent (wrong without a word), crash (a traceback for a user error), lost (data
or state damaged). The fast test runs every case in-process and prints `FAULT <name> <class>` lines
and the totals; the slow one drives `mrl train` (resume and `checkpoint.load_from`) end to end."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

from mrl.checkpoint import store
from mrl.errors import SpecError, UserError
from tests.checkpoint.test_untrusted_reads import _crafted
from tests.dist_util import REPO

REWARDS = str(REPO / "tests/reward/privilege_rewards.py")
CLASSES = ("handled", "silent", "crash", "lost")


def _one_line(text: str) -> bool:
    return bool(text) and "\n" not in text.strip() and "Traceback" not in text


def _merge(tmp: Path, which: str) -> tuple[str, str]:
    from mrl.cli import main

    marker = tmp / "pwned"
    _crafted(tmp / "ckpt", marker, which)
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["merge", str(tmp / "ckpt"), str(tmp / "out")])
    if marker.exists():
        return "lost", "the payload ran"
    return ("handled" if rc == 2 and _one_line(err.getvalue()) else "silent"), err.getvalue().strip()


def _merge_changed_after_manifest(tmp: Path) -> tuple[str, str]:
    from mrl.merge.source import inspect

    d = _crafted(tmp / "ckpt", tmp / "pwned", "common.pt")
    (d / ".metadata").write_bytes(b"not what was saved")
    try:
        inspect(tmp / "ckpt")
    except UserError as e:
        return ("handled" if "was not read: .metadata" in str(e) and _one_line(str(e)) else "silent"), str(e)
    return "silent", "read"


def _latest(tmp: Path, how: str) -> tuple[str, str]:
    root, foreign = tmp / "run" / "actor", tmp / "other" / "actor"
    for r in (root, foreign):
        (r / "step_00000001").mkdir(parents=True)
    if how == "symlink":
        os.symlink(foreign / "step_00000001", root / "step_00000007")
    name = {"absolute": str(foreign / "step_00000001"), "dotdot": "../../other/actor/step_00000001",
            "symlink": "step_00000007"}[how]
    (root / "latest").write_text(name + "\n")
    try:
        got = store.latest(root)
    except UserError as e:
        return ("handled" if _one_line(str(e)) else "silent"), str(e)
    return ("lost" if got is not None and foreign in got.resolve().parents else "silent"), f"resumed from {got}"


def _reward(name: str, extra: dict, **pool_kw):
    from mrl.reward.pool import Call, RewardPool

    with RewardPool([f"{REWARDS}:{name}"], workers=1, timeout_s=5.0, **pool_kw) as pool:
        return pool.run([Call(f"{REWARDS}:{name}", ("q", "r", "g", extra), {})])[0], pool


def _reward_secrets(tmp: Path) -> tuple[str, str]:
    # values no environment holds by chance: the reward searches its whole environment block for them
    secrets = {k: f"mrl-fault-s3cr3t-{k.lower()}" for k in
               ("MLFLOW_TRACKING_TOKEN", "WANDB_API_KEY", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY")}
    old = {k: os.environ.get(k) for k in secrets}
    os.environ.update(secrets)
    try:
        out, _ = _reward("environment", {"names": sorted(secrets), "values": secrets})
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    seen = out.value["seen"] + out.value["in_block"]
    return ("handled" if not seen else "lost"), f"visible to the reward: {sorted(set(seen)) or 'none'}"


def _reward_daemon(tmp: Path) -> tuple[str, str]:
    pidfile = tmp / "pid"
    _reward("daemon", {"pidfile": str(pidfile)})
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    break
        except OSError:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        return "silent", f"daemon {pid} outlived the pool"
    return "handled", "the double-forked daemon died with the pool"


def _reward_slow_unpickle(tmp: Path) -> tuple[str, str]:
    t0 = time.monotonic()
    out, _ = _reward("slow_value", {})
    took = time.monotonic() - t0
    return ("handled" if took < 5.0 and "SlowToUnpickle" in str(out.value) else "silent"), \
        f"returned {out.value!r} after {took:.1f} s"


def _reward_float_subclass(tmp: Path) -> tuple[str, str]:
    out, _ = _reward("float_subclass", {})
    return ("handled" if out.error is None and out.value == {"score": 0.75, "bonus": 2.0} else "crash"), repr(out)


def _reward_writes_run(tmp: Path) -> tuple[str, str]:
    run = tmp / "runs" / "job" / "checkpoints"
    run.mkdir(parents=True)
    out, pool = _reward("writes", {"target": str(run)}, protect_dirs=(str(run.parent),))
    if pool.unprotected:
        return "silent", f"not enforced here: {pool.unprotected}"
    planted = (run / "planted.txt").exists()
    return ("lost" if planted else "handled"), out.message


def _extends(tmp: Path, target: str) -> tuple[str, str]:
    from mrl.config.loader import load as load_spec

    if target == "fifo":
        os.mkfifo(tmp / "base.toml")
        target = "base.toml"
    (tmp / "a.toml").write_text(f'extends = "{target}"\n')
    t0 = time.monotonic()
    try:
        load_spec(tmp / "a.toml")
    except SpecError as e:
        lines = [line for line in str(e).splitlines() if "extends" in line]
        return ("handled" if len(lines) == 1 and time.monotonic() - t0 < 10 else "silent"), lines[0] if lines else str(e)
    return "silent", "accepted"


CASES = {
    "merge_crafted_dot_metadata": lambda t: _merge(t, ".metadata"),
    "merge_crafted_common_pt": lambda t: _merge(t, "common.pt"),
    "merge_file_changed_after_manifest": _merge_changed_after_manifest,
    "latest_absolute_path": lambda t: _latest(t, "absolute"),
    "latest_dotdot": lambda t: _latest(t, "dotdot"),
    "latest_symlink_out_of_root": lambda t: _latest(t, "symlink"),
    "reward_reads_secrets": _reward_secrets,
    "reward_double_forked_daemon": _reward_daemon,
    "reward_value_unpickling_sleeps": _reward_slow_unpickle,
    "reward_float_subclass_from_its_file": _reward_float_subclass,
    "reward_writes_run_directory": _reward_writes_run,
    "extends_fifo": lambda t: _extends(t, "fifo"),
    "extends_dev_zero": lambda t: _extends(t, "/dev/zero"),
    "extends_dev_urandom": lambda t: _extends(t, "/dev/urandom"),
}


def test_hostile_inputs_are_handled(tmp_path):
    got = {}
    for name, case in CASES.items():
        d = tmp_path / name
        d.mkdir()
        try:
            got[name] = case(d)
        except Exception:  # noqa: BLE001 - a traceback is a "crash" of the case, counted
            got[name] = ("crash", traceback.format_exc().strip().splitlines()[-1])
        print(f"FAULT {name} {got[name][0]} {got[name][1][:200]}")
    counts = {c: sum(v[0] == c for v in got.values()) for c in CLASSES}
    print(f"tried {len(got)}, " + ", ".join(f"{c} {n}" for c, n in counts.items()))
    assert counts["handled"] == len(CASES), {k: v for k, v in got.items() if v[0] != "handled"}


# ----------------------------------------------------------------------------- end to end: mrl train

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _train(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mrl", "train", "jobs/quickstart_cpu.toml", "platform.ranks_per_node=1",
           "parallel.tensor=1", f"job.output_dir={out}", "tracking.backends=[]", "checkpoint.every_steps=1", *overrides]
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=400)


def _plant(step: Path, which: str, marker: Path) -> None:
    """Replace `which` in the saved step with a payload and re-write the manifest to match."""
    import json
    import pickle

    from mrl.checkpoint import manifest
    from tests.checkpoint.test_untrusted_reads import Evil

    with open(step / which, "wb") as f:
        pickle.dump({"extra": Evil(str(marker))}, f)
    body = json.loads((step / "manifest.json").read_text())
    body["files"][which] = manifest.file_entry(step / which)
    (step / "manifest.json").write_text(json.dumps(body))


@pytest.mark.slow
def test_train_resume_and_load_from_run_no_code_from_a_crafted_checkpoint(tmp_path):
    first = _train(tmp_path, "job.name=src", "trainer.total_steps=1")
    assert first.returncode == 0, first.stderr[-3000:]
    src = tmp_path / "src" / "checkpoints" / "actor"
    marker = tmp_path / "pwned"
    results = {}
    for which in (".metadata", "common.pt"):
        for how in ("resume", "load_from"):
            name = f"{how}_{which.strip('.').replace('.', '_')}"
            victim = tmp_path / name / "checkpoints" / "actor" if how == "resume" else tmp_path / f"{name}_ckpt"
            shutil.copytree(src, victim)
            _plant(victim / "step_00000001", which, marker)
            if how == "resume":   # the attacker rewrites the manifest's job too: the payload must still not run
                body = json.loads((victim / "step_00000001" / "manifest.json").read_text())
                body["job"] = {"name": name, "run_dir": str((tmp_path / name).resolve())}
                (victim / "step_00000001" / "manifest.json").write_text(json.dumps(body))
            extra = [f"checkpoint.load_from={victim}"] if how == "load_from" else []
            proc = _train(tmp_path, f"job.name={name}", "trainer.total_steps=2", *extra)
            errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
            results[name] = (proc.returncode, errors, marker.exists())
            assert proc.returncode == 2 and len(errors) == 1 and "not plain" in errors[0], proc.stderr[-3000:]
            assert "Traceback" not in proc.stderr and not marker.exists()
            print(f"FAULT {name} handled {errors[0][:200]}")
    # `latest` naming a step of another run: refused, the other run's checkpoint is not loaded
    victim = tmp_path / "latest_out" / "checkpoints" / "actor"
    victim.mkdir(parents=True)
    (victim / "latest").write_text(f"{src / 'step_00000001'}\n")
    proc = _train(tmp_path, "job.name=latest_out", "trainer.total_steps=2")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "refused" in errors[0], proc.stderr[-3000:]
    print(f"FAULT latest_names_another_run handled {errors[0][:200]}")
