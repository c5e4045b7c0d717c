"""The full-vocabulary reverse KL at TP2 (torchrun, gloo; a few seconds)."""
from __future__ import annotations

import pytest

from tests.engine.test_engine_dist import _run

pytestmark = pytest.mark.slow


def test_reverse_kl_over_a_split_vocabulary_equals_whole_rows():
    _run("distill_kl_tp.py", expect={"distill_kl_tp2_value": 1e-5, "distill_kl_tp2_grad": 1e-6})
