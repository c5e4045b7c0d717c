import os

import pytest

# Keep CPU tests deterministic and light on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Directories whose test files share a session fixture that costs a launch (tests/merge: one
# torchrun saves every checkpoint) or one service (tests/launch: the one-node Slurm cluster): their
# files run on one xdist worker, so the fixture is built once and two Slurm jobs never compete.
SHARED_DIRS = ("tests/merge/", "tests/launch/")


def xdist_unit(nodeid: str) -> str:
    """The unit one xdist worker runs whole: the test's file (its module fixtures are built once),
    or its directory when that is in SHARED_DIRS."""
    path = nodeid.split("::")[0]
    return next((d for d in SHARED_DIRS if path.startswith(d)), path)


def slow_units_first(items: list) -> None:
    """Put the units holding slow tests first (in place; a stable sort, so files and tests keep
    their order otherwise)."""
    slow = {xdist_unit(i.nodeid) for i in items if i.get_closest_marker("slow")}
    items.sort(key=lambda i: xdist_unit(i.nodeid) not in slow)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Units holding slow tests (long launches) run first: under `make test` (`pytest -n 2`), the
    two workers start with them and the many short files fill in behind; a long launch handed out
    last would leave one worker idle while it runs."""
    slow_units_first(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test` (`pytest -n 2 --dist loadfile`): xdist's file units, widened to `xdist_unit`,
    handed out in collection order (slow units first) instead of largest-file-first. Other modes
    (`-n N` alone: test by test, as `make gpu-check` runs) are xdist's own. (xdist's `loadgroup`
    marks cannot group here: under pytest 9 the node-id rename they rely on is not read.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class UnitScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_unit(nodeid)

    config.option.loadscopereorder = False   # keep the collection order: slow units first
    return UnitScheduling(config, log)
