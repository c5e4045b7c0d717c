"""`checkpoint.save_hf_at_end`: the finished run's actor as a Hugging Face directory.

After the last step's checkpoint is written and the trainer's process group is gone, rank 0 runs
`mrl merge` on it in a fresh process (the trainer's models and parallel state stay out of the way;
merge brings up its own one-rank platform) and writes `<job.output_dir>/<job.name>/hf/step_<N>`.
Merge verifies the output against the checkpoint's logits below 2B parameters.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mrl.errors import UserError


def hf_dir(spec, step: int) -> Path:
    from mrl.tracking.tracker import run_dir_of

    return run_dir_of(spec) / "hf" / f"step_{step}"


def export_hf(spec, checkpoint_root: Path, step: int, *, rank: int, say=print) -> Path | None:
    """Merge the latest actor checkpoint under `checkpoint_root` (saved at the final `step`) into
    `hf_dir(spec, step)` on rank 0 (None elsewhere).
    An existing output (a finished run started again) is kept."""
    if rank != 0:
        return None
    out = hf_dir(spec, step)
    if out.exists() and any(out.iterdir()):
        say(f"Hugging Face export already in {out}")
        return out
    ckpt = Path(checkpoint_root) / "actor"   # merge reads its latest checkpoint: the one just saved
    cmd = [sys.executable, "-m", "mrl", "merge", str(ckpt), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        why = lines[-1] if lines else f"exit code {proc.returncode}"
        raise UserError(f"checkpoint.save_hf_at_end: mrl merge {ckpt} {out} failed: {why}")
    say(f"Hugging Face export: {out}")
    return out
