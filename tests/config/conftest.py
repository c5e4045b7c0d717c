import copy
from pathlib import Path

import pytest
import tomli_w

from mrl.cli import main

BASE = {
    "platform": {"device": "cpu", "ranks_per_node": 2},
    "model": {"path": "builtin:tiny-qwen2", "dtype": "float32"},
    "data": {"generator": "mrl.data.generators:arithmetic", "prompts_per_step": 4, "max_prompt_tokens": 64},
    "rollout": {"engine": "hf", "responses_per_prompt": 4, "max_response_tokens": 32},
    "actor": {"micro_batch_tokens": 512},
    "reward": {"builtin": "exact_match"},
}


def deep_merge(base: dict, patch: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in patch.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        elif v is DELETE:
            out.pop(k, None)
        else:
            out[k] = v
    return out


DELETE = object()


@pytest.fixture
def write_job(tmp_path):
    """Write BASE patched with `patch` (or raw `text`) to a file; return its path."""
    def write(patch: dict | None = None, text: str | None = None, name: str = "job.toml"):
        path = tmp_path / name
        path.write_text(text if text is not None else tomli_w.dumps(deep_merge(BASE, patch or {})))
        return path
    return write


@pytest.fixture
def cli(capsys, monkeypatch):
    """Run `mrl ARGS...` in-process from the repository root; return (exit code, stdout, stderr)."""
    monkeypatch.chdir(Path(__file__).resolve().parents[2])

    def run(*args: str):
        rc = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return rc, out, err
    return run
