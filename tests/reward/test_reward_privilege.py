"""Rewards run with least privilege: an allowlisted environment, their whole process tree killed
with the pool, results as plain data, and the run directory unwritable (Landlock, where present)."""
import math
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mrl.reward.compose import Rewarder, RewardSample
from mrl.reward.pool import Call, RewardPool, plain
from mrl.reward.sandbox import ENV_ALLOW, deny_writes, worker_env
from mrl.reward.sources import RewardSource

FUNCS = str(Path(__file__).with_name("privilege_rewards.py"))
SECRETS = {"MLFLOW_TRACKING_TOKEN": "mlflow-s3cr3t", "WANDB_API_KEY": "wandb-s3cr3t", "HF_TOKEN": "hf-s3cr3t",
           "AWS_SECRET_ACCESS_KEY": "aws-s3cr3t", "GITHUB_TOKEN": "gh-s3cr3t", "MY_SERVICE_KEY": "svc-s3cr3t",
           "DB_SECRET_PASSWORD": "db-s3cr3t", "MLFLOW_TRACKING_URI": "http://tracking"}


def call(name, **extra):
    return Call(f"{FUNCS}:{name}", ("q", "r", "g", extra), {})


def test_worker_env_keeps_the_allowlist_only():
    env = {"PATH": "/bin", "LC_ALL": "C", **SECRETS}
    assert worker_env((), env) == {"PATH": "/bin", "LC_ALL": "C"}
    assert worker_env(("MY_*",), env) == {"PATH": "/bin", "LC_ALL": "C", "MY_SERVICE_KEY": "svc-s3cr3t"}
    shaped = ["GH_TOKEN", "API_KEY", "X_SECRET_Y", "MLFLOW_TRACKING_PASSWORD", "WANDB_ENTITY", "HF_TOKEN", "AWS_REGION"]
    assert worker_env((), {k: "v" for k in shaped}) == {} and "PATH" in ENV_ALLOW


def test_rewards_see_no_secrets_unless_allowlisted(monkeypatch):
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    extra = {"names": sorted(SECRETS), "values": SECRETS}
    with RewardPool([f"{FUNCS}:environment"], workers=1, timeout_s=10.0) as pool:
        (out,) = pool.run([call("environment", **extra)])
        assert out.error is None, out.message
        assert out.value["seen"] == [] and out.value["in_block"] == [] and out.value["has_path"]
        assert os.path.basename(out.value["tmp"]).startswith("mrl-reward-")   # a private TMPDIR
    with RewardPool([f"{FUNCS}:environment"], workers=1, timeout_s=10.0, env_allow=("MY_SERVICE_KEY", "HF_*")) as pool:
        (out,) = pool.run([call("environment", **extra)])
        assert out.value["seen"] == ["HF_TOKEN", "MY_SERVICE_KEY"] == out.value["in_block"]
    assert os.environ["HF_TOKEN"] == "hf-s3cr3t"   # the trainer's own environment is untouched


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_double_forked_daemon_does_not_outlive_the_pool(tmp_path):
    pidfile = tmp_path / "daemon.pid"
    with RewardPool([f"{FUNCS}:daemon"], workers=1, timeout_s=10.0) as pool:
        (out,) = pool.run([call("daemon", pidfile=str(pidfile))])
        assert out.error is None, out.message
        daemon = int(pidfile.read_text())
        assert _alive(daemon)
    deadline = time.monotonic() + 5
    while _alive(daemon) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(daemon)


def test_a_value_whose_unpickling_sleeps_does_not_hold_scoring():
    src = [RewardSource("slow", "function", f"{FUNCS}:slow_value"), RewardSource("sub", "function", f"{FUNCS}:float_subclass")]
    with Rewarder(src, workers=2, timeout_s=5.0) as r:
        t0 = time.monotonic()
        res = r.score([RewardSample(sample_id="s0", prompt="q", response="r", ground_truth="g")])
        took = time.monotonic() - t0
    assert took < 5.0, took
    (err,) = res.errors
    assert (err.source, err.kind) == ("slow", "not_a_number") and "SlowToUnpickle" in err.message
    assert res.metrics["sub/bonus"] == [2.0]   # a float subclass from the reward file arrives as a float


def test_plain_turns_values_into_json_data():
    class F(float):
        pass

    got = plain({"score": F(0.5), "n": np.int64(3), "x": np.float32(1.5), "t": torch.tensor(2.0), 1: [True, None],
                 "o": object(), "big": 10**400})
    assert got == {"score": 0.5, "n": 3, "x": 1.5, "t": 2.0, "1": [True, None], "o": "<object>", "big": 10**400}
    assert type(got["score"]) is float and type(got["n"]) is int
    assert math.isnan(plain(float("nan")))
    deep: list = []
    for _ in range(40):
        deep = [deep]
    with pytest.raises(ValueError):
        plain(deep)


def test_the_run_directory_is_not_writable_from_a_reward(tmp_path):
    run = tmp_path / "runs" / "job"
    (run / "checkpoints").mkdir(parents=True)
    with RewardPool([f"{FUNCS}:writes"], workers=1, timeout_s=10.0, protect_dirs=(str(run),)) as pool:
        outs = pool.run([call("writes", target=str(run)), call("writes", target=str(run / "checkpoints")),
                         call("writes", target=str(tmp_path))])
        if pool.unprotected:
            pytest.skip(f"not enforced here: {pool.unprotected}")
    assert [o.error for o in outs[:2]] == ["exception", "exception"], outs
    assert all("PermissionError" in o.message for o in outs[:2])
    assert not list(run.rglob("planted.txt"))
    # an ancestor of the run directory: no new entries in it either; elsewhere writes work
    assert outs[2].error == "exception" and not (tmp_path / "planted.txt").exists()


def test_deny_writes_elsewhere_is_untouched(tmp_path):
    """deny_writes in a child process: siblings of the protected directory stay writable."""
    import subprocess
    import sys

    (tmp_path / "run").mkdir()
    (tmp_path / "other").mkdir()
    code = ("import sys; from mrl.reward.sandbox import deny_writes\n"
            f"why = deny_writes([{str(tmp_path / 'run')!r}])\n"
            "print('SKIP', why) if why else None\n"
            f"open({str(tmp_path / 'other' / 'ok')!r}, 'w').write('x')\n"
            f"try:\n    open({str(tmp_path / 'run' / 'no')!r}, 'w')\nexcept PermissionError:\n    print('DENIED')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    if out.stdout.startswith("SKIP"):
        pytest.skip(out.stdout)
    assert out.stdout.strip() == "DENIED", out.stderr
    assert (tmp_path / "other" / "ok").exists() and not (tmp_path / "run" / "no").exists()
    assert deny_writes([]) is None
