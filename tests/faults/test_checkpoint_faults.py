"""Fault battery, checkpoints: every damaged-latest case resumes from the previous step with one
line; `resume = "must"` refuses; a crafted RNG file runs no code; `save_optimizer = false` resumes.
The script prints one `FAULT name handled|lost detail` line per case (figures for the report)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.dist_util import run_torchrun

SCRIPTS = Path(__file__).parent / "scripts"
CASES = ("truncated_distcp", "empty_distcp", "truncated_common_pt", "missing_dot_metadata", "broken_metadata_json",
         "empty_step_dir", "flipped_sign_bits", "broken_manifest", "flipped_optim_shard", "missing_optim_index")


def faults(stdout: str) -> dict[str, tuple[str, str]]:
    return {m.group(1): (m.group(2), m.group(3)) for m in re.finditer(r"^FAULT (\S+) (handled|lost) ?(.*)$", stdout, re.M)}


@pytest.mark.slow
def test_damaged_checkpoints_fall_back_and_crafted_files_run_no_code(tmp_path):
    out = run_torchrun(SCRIPTS / "ckpt_faults.py", str(tmp_path), nproc=2, timeout=400).stdout
    got = faults(out)
    want = {*CASES, *(f"{c}_resume_again" for c in CASES), "must_refuses_damaged_latest", "crafted_rng_file", "crafted_dcp_metadata",
            "save_optimizer_false_resumes"}
    assert set(got) == want, out
    lost = {k: v for k, v in got.items() if v[0] != "handled"}
    assert not lost, lost
    for name, (_, line) in sorted(got.items()):
        print(f"{name}: {line}")


@pytest.mark.slow
def test_disk_full_mid_save_is_one_line_and_leaves_no_partial_save(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    # a 150 KiB filesystem: the probe fits, the checkpoint (about 250 KiB) does not
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=150k", "tmpfs", str(full)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        out = run_torchrun(SCRIPTS / "ckpt_enospc.py", str(full), nproc=2, timeout=300).stdout
    finally:
        subprocess.run(["umount", str(full)], check=False)
    got = faults(out)
    assert got["disk_full_mid_save"][0] == "handled", out
    print(got["disk_full_mid_save"][1])
