from pathlib import Path

import pytest

from mrl.cli import main


@pytest.fixture
def cli(capsys, monkeypatch):
    """Run `mrl ARGS...` in-process from the repository root; return (exit code, stdout, stderr)."""
    monkeypatch.chdir(Path(__file__).resolve().parents[2])

    def run(*args):
        rc = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return rc, out, err
    return run
