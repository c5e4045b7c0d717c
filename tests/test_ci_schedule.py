"""How `make test` splits the suite over its pytest-xdist workers (tests/conftest.py): a file is
one unit (tests/merge and tests/launch: the directory), and units with slow tests go first."""
from __future__ import annotations

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
