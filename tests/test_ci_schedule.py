"""How `make test` splits the suite over its pytest-xdist workers (tests/conftest.py): a file is
one unit (tests/merge and tests/launch: the directory), and units with slow tests go first."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import slow_units_first, xdist_unit


class Item:
    def __init__(self, nodeid: str, slow: bool = False):
        self.nodeid, self.marks = nodeid, [pytest.mark.slow.mark] if slow else []

    def get_closest_marker(self, name):
        return next((m for m in self.marks if m.name == name), None)


def test_a_file_is_a_unit_and_shared_fixture_directories_are_one():
    assert xdist_unit("tests/train/test_train.py::test_x[a-b]") == "tests/train/test_train.py"
    assert xdist_unit("tests/merge/test_merge_vlm.py::test_y") == "tests/merge/"
    assert xdist_unit("tests/launch/test_slurm.py::test_z") == "tests/launch/"
    assert xdist_unit("tests/test_architecture.py::test_a") == "tests/test_architecture.py"


def test_units_holding_slow_tests_go_first_and_keep_their_order():
    items = [Item("tests/a/test_fast.py::t1"), Item("tests/a/test_mixed.py::t1"),
             Item("tests/a/test_mixed.py::t2", slow=True), Item("tests/merge/test_m.py::t1"),
             Item("tests/b/test_fast.py::t1"), Item("tests/merge/test_n.py::t1", slow=True),
             Item("tests/a/test_mixed.py::t3")]
    slow_units_first(items)
    assert [i.nodeid for i in items] == [
        "tests/a/test_mixed.py::t1", "tests/a/test_mixed.py::t2", "tests/merge/test_m.py::t1",
        "tests/merge/test_n.py::t1", "tests/a/test_mixed.py::t3", "tests/a/test_fast.py::t1",
        "tests/b/test_fast.py::t1"]


def test_make_tests_workers_run_each_unit_whole(tmp_path):
    """`pytest -n 2 --dist loadfile` with this conftest, on a small suite: every file's tests, and
    every tests/merge/ file's, run on one worker, and both workers get work. (This caught xdist's
    `loadgroup` marks doing nothing under pytest 9.)"""
    pytest.importorskip("xdist")
    (tmp_path / "tests").mkdir()
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "tests")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n")
    body = ("import os\nimport pytest\n\n{mark}def test_{i}():\n"
            "    open(os.environ['OUT'] + '/{name}_{i}', 'w').write(os.environ['PYTEST_XDIST_WORKER'])\n")
    files = {"tests/merge/test_a.py": "", "tests/merge/test_b.py": "", "tests/x/test_c.py": "@pytest.mark.slow\n",
             "tests/x/test_d.py": "", "tests/test_e.py": ""}
    for rel, mark in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        name = rel.replace("/", "_")
        (tmp_path / rel).write_text("\n".join(body.format(mark=mark, i=i, name=name) for i in range(3)))
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider",
                           "tests"], cwd=tmp_path, env={**os.environ, "OUT": str(out)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    worker = {p.name: p.read_text() for p in out.iterdir()}
    assert len(worker) == 15
    unit_workers = {}
    for name, w in worker.items():
        unit = "merge" if name.startswith("tests_merge_") else name.rsplit("_", 1)[0]
        unit_workers.setdefault(unit, set()).add(w)
    assert all(len(ws) == 1 for ws in unit_workers.values()), unit_workers
    assert len(set(worker.values())) == 2, worker
