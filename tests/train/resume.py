"""Exact-resume checks that share one launch: every variant's uninterrupted run and its stopped
and resumed twin run in one `run_jobs` process (one `train()` each, in order)."""
from __future__ import annotations

from pathlib import Path

from tests.train.test_train import history, run_jobs

SKIP = ("time/", "throughput/", "memory/", "weight_sync/")


def resume_sets(*variants: str, steps: int = 4, stop: int = 2) -> list[str]:
    """`run_jobs` override sets: for each override string in `variants`, a run of `steps` steps
    (job `whole<i>`), and a run stopped after `stop` steps then resumed to `steps` (job
    `resumed<i>`; the variant must checkpoint at `stop`)."""
    sets = []
    for i, v in enumerate(variants):
        sets += [f"{v} job.name=whole{i} trainer.total_steps={steps}",
                 f"{v} job.name=resumed{i} trainer.total_steps={stop}",
                 f"{v} job.name=resumed{i} trainer.total_steps={steps}"]   # picks up at step stop + 1
    return sets


def whole_and_resumed(job: str, out: Path, *variants: str, steps: int = 4, stop: int = 2,
                      timeout: float = 900) -> list[tuple[dict, dict]]:
    """`resume_sets`, all in one launch. -> [(uninterrupted history, resumed history)] per
    variant (`history`'s metric -> {step: value})."""
    run_jobs(job, out, *resume_sets(*variants, steps=steps, stop=stop), timeout=timeout)
    return [(history(out / f"whole{i}"), history(out / f"resumed{i}")) for i in range(len(variants))]


def assert_resumed_exactly(whole: dict, again: dict, steps: int = 4) -> list[str]:
    """Every metric of the uninterrupted run (but timings, throughput, memory, weight sync) has the
    same value at every step in the resumed run. -> the metric names compared."""
    keys = [k for k in whole if not k.startswith(SKIP)]
    assert keys and set(keys) <= set(again), sorted(set(keys) - set(again))
    for k in keys:
        assert sorted(again[k]) == list(range(1, steps + 1)), k
        assert again[k] == whole[k], (k, whole[k], again[k])
    return keys
