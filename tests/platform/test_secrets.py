"""The trainer's secrets do not reach its children through /proc (issue 34, breach 2).

`scripts/secret_children.py` starts, with a secret in its environment, every kind of child the
trainer starts: a reward worker (whose own environment is filtered), an MCP stdio server, a
sandboxed program under test, and a plain subprocess; each reads `/proc/<trainer pid>/environ`.
Unprotected, they read the secret (the attack is real); after `mrl.platform.lifetime.boot` (what
`python -m mrl` does first) none does: the trainer is non-dumpable (a non-root child gets EACCES)
and its environment block is blanked (a root child, as in this test, reads NUL bytes), while the
trainer itself and the children it hands its environment to still see every variable. A local
judge runs in the scoring process (no child on CPU); vLLM's engine processes are its own code and
get the environment they need."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_cli import ENV, REPO

SECRET = "mrl-test-secret-4f1c"
SCRIPT = Path(__file__).with_name("scripts") / "secret_children.py"
CHILDREN = ("reward_worker", "reward_worker_parent", "mcp_stdio_server", "code_sandbox", "plain_child")


def _children(mode: str) -> dict:
    r = subprocess.run([sys.executable, str(SCRIPT), mode], cwd=REPO, env={**ENV, "SECRET_TOKEN": SECRET},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def unprotected():
    return _children("unprotected")


@pytest.fixture(scope="module")
def protected():
    return _children("protected")


def test_unprotected_children_read_the_secret(unprotected):
    assert {k: unprotected[k] for k in ("reward_worker", "reward_worker_parent", "mcp_stdio_server", "plain_child")} \
        == dict.fromkeys(("reward_worker", "reward_worker_parent", "mcp_stdio_server", "plain_child"), "secret")
    assert unprotected["dumpable"] == 1


@pytest.mark.parametrize("child", CHILDREN)
def test_no_child_reads_the_trainers_secret(protected, child):
    # "error 2": no such process (a sandboxed program has its own PID namespace: the trainer is not there)
    assert protected[child] in {"denied", "blank", "error 2"}, protected


def test_the_trainer_and_the_children_it_hands_its_environment_keep_it(protected):
    assert protected["dumpable"] == 0
    assert protected["trainer_os_environ"] == protected["trainer_getenv"] == SECRET
    assert protected["inheriting_child"] == SECRET


def test_python_m_mrl_boots_before_anything_else():
    body = ast.parse((REPO / "mrl" / "__main__.py").read_text()).body
    calls = [n for n in body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)]
    first_mrl_import = next(i for i, n in enumerate(body) if isinstance(n, ast.ImportFrom) and n.module == "mrl.cli")
    boot_at = next(i for i, n in enumerate(body) if n in calls and getattr(n.value.func, "id", "") == "boot")
    assert boot_at < first_mrl_import
