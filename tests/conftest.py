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


def xdist_schedule(items: list) -> None:
    """Mark each item with its unit as an xdist group and put the units holding slow tests first
    (in place; a stable sort, so files and tests keep their order otherwise)."""
    slow = {xdist_unit(i.nodeid) for i in items if i.get_closest_marker("slow")}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(xdist_unit(item.nodeid)))
    items.sort(key=lambda i: xdist_unit(i.nodeid) not in slow)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Balance `make test` (`pytest -n 2 --dist loadgroup --no-loadscope-reorder`): each unit is an
    xdist group, and the units holding slow tests (long launches) come first, so the two workers
    start with them and the many short files fill in behind; a long launch handed out last would
    leave one worker idle while it runs. Without xdist the groups are inert and only the order
    changes (slow files first)."""
    xdist_schedule(items)
