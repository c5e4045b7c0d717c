"""A pytest plugin that appends one JSON line per test phase to `$MRL_GPU_CHECK_RECORD`.

`tools/gpu/check.py` loads it (`-p pytest_record`) to collect pass/fail per test. Lines are
written and flushed as each phase ends, so a run stopped by the check's time budget still leaves
the outcome of every test that finished (junit XML is only written at the end of a session).
Each line: `{"nodeid", "when": collect|setup|call|teardown, "outcome": passed|failed|skipped,
"duration_s", "message"}`; `message` is the skip reason or the failure's last lines.
"""
from __future__ import annotations

import json
import os

_ENV = "MRL_GPU_CHECK_RECORD"


def _message(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):  # (file, line, "Skipped: reason")
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    if report.failed:
        return "\n".join(report.longreprtext.strip().splitlines()[-15:])
    return ""


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get(_ENV)
    if not path:
        return
    line = dict(nodeid=report.nodeid, when=report.when, outcome=report.outcome,
                duration_s=round(report.duration, 3), message=_message(report))
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def pytest_collectreport(report) -> None:
    """A module that fails to import (a missing package) is recorded as a failed test."""
    path = os.environ.get(_ENV)
    if not path or not report.failed:
        return
    line = dict(nodeid=report.nodeid, when="collect", outcome="failed", duration_s=0.0,
                message="\n".join(report.longreprtext.strip().splitlines()[-15:]))
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
