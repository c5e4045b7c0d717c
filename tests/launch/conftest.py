from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch.launch_util import find_venv


@pytest.fixture(scope="session")
def mrl_venv() -> Path:
    return find_venv()
