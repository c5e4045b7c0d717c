"""Online DPO through the engine at DP2 and TP2 (torchrun, gloo): loss and gradients equal one
naive call over the whole mini-batch and do not depend on the micro-batch split or the padding
(tests/engine/scripts/dpo_equivalence.py; ~40 s on 2 cores)."""
from __future__ import annotations

import pytest

from tests.engine.test_engine_dist import _run

pytestmark = pytest.mark.slow


def test_dpo_ipo_simpo_do_not_depend_on_split_padding_or_layout():
    naive = {"dpo": 1e-6, "ipo": 1e-5, "simpo": 1e-6}
    expect = {}
    for name, tol in naive.items():
        for k in (1, 2, 4):
            for pad in (0, 5):
                for what in ("grads", "loss"):
                    expect[f"dp2_{name}_mb{k}_pad{pad}_{what}"] = tol
                    if (k, pad) != (1, 0):
                        expect[f"dp2_{name}_mb{k}_pad{pad}_vs_mb1_{what}"] = 1e-6
    for name in ("dpo", "ipo"):
        for k in (1, 3):
            for pad in (0, 5):
                for what in ("grads", "loss"):
                    expect[f"tp2_{name}_mb{k}_pad{pad}_{what}"] = naive[name]
    expect.update({f"cp2_dpo_mb{k}_{what}": naive["dpo"] for k in (1, 3) for what in ("grads", "loss")})
    _run("dpo_equivalence.py", expect=expect)
