"""HF -> Megatron -> HF round trips and logits parity at TP=2, PP=2, EP=2 and DP=2 (2 gloo ranks)."""
from __future__ import annotations

import re
import shutil

import pytest
import torch

from tests.dist_util import REPO, run_torchrun
from tests.weights.conftest import ALL_ARCHS

SCRIPT = REPO / "tests/weights/scripts/roundtrip.py"
MOE = {"qwen3_moe", "qwen2_moe", "mixtral"}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_round_trip_is_exact_and_logits_match_transformers(arch, hf_checkpoint, tmp_path):
    layouts = ["tp2", "pp2", "dp2"] + (["ep2"] if arch in MOE else [])
    proc = run_torchrun(SCRIPT, "--dir", str(hf_checkpoint(arch)), "--layouts", *layouts, "--out", str(tmp_path),
                        timeout=600)
    assert len(re.findall(r"^ROUNDTRIP .* ok", proc.stdout, re.M)) == len(layouts), proc.stdout
    diffs = [float(x) for x in re.findall(r"^MAXDIFF .* logits (\S+)", proc.stdout, re.M)]
    assert len(diffs) == len(layouts) and max(diffs) <= 1e-5, proc.stdout

    # The export written by rank 0 (TP=2 layout) loads in transformers with identical logits.
    from transformers import AutoModelForCausalLM

    shutil.copy(hf_checkpoint(arch) / "config.json", tmp_path / "config.json")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ref = torch.load(hf_checkpoint(arch) / "reference.pt")
    with torch.no_grad():
        assert torch.equal(model(ref["tokens"]).logits, ref["logits"])
