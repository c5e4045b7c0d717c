"""`trainer.profile_steps`: torch.profiler traces of chosen training steps.

Each listed step runs under `torch.profiler.profile` (CPU, plus CUDA on GPUs) and writes a Chrome
trace per rank to `<job.output_dir>/<job.name>/profile/step_<N>/rank_<r>.json` (open it in
chrome://tracing or https://ui.perfetto.dev). Other steps run unprofiled.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator


def trace_path(run_dir: Path, step: int, rank: int) -> Path:
    return Path(run_dir) / "profile" / f"step_{step}" / f"rank_{rank}.json"


@contextlib.contextmanager
def profile_step(steps: tuple[int, ...], step: int, run_dir: Path, rank: int) -> Iterator[None]:
    """Profile the body when `step` is in `steps`; write its trace when the step ends."""
    if step not in steps:
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    out = trace_path(run_dir, step, rank)
    out.parent.mkdir(parents=True, exist_ok=True)
    with profile(activities=activities, record_shapes=False) as prof:
        yield
    prof.export_chrome_trace(str(out))
