"""The life of a run on one rank, shared by `mrl train` and `mrl sft`: how it ends.

- The run directory and the checkpoint directory are locked first (`mrl.checkpoint.lock`): a
  second launch of the same job, or another job given the same `checkpoint.dir`, fails in one
  line before it touches a checkpoint or the MLflow store.
- SIGTERM (torchrun, Slurm, `kill`) raises `SystemExit(143)` in the main thread, so the run
  unwinds like Ctrl-C instead of dying mid-write.
- The run's status is FINISHED when the body said so (`Lifecycle.finished()`), KILLED on Ctrl-C or
  SIGTERM, FAILED otherwise; the tracker (once the body made one) is finished with it, so MLflow
  never shows a dead run as RUNNING.
- Then the rank's engines and workers are closed, the process groups torn down, and after a
  FINISHED run with `checkpoint.save_hf_at_end` rank 0 writes the Hugging Face export of the last
  checkpoint (`mrl.train.export`).
"""
from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path
from typing import Callable, Iterator, Optional


class Lifecycle:
    """What the body of `run_lifecycle` tells it: the tracker, and that it finished."""

    def __init__(self):
        self.tracker = None          # mrl.tracking.tracker.Tracker, once the body made it
        self.status = "FAILED"
        self.export_steps: Optional[int] = None   # the final step to export (None: no export on this rank)

    def finished(self, export_steps: Optional[int] = None) -> None:
        self.status = "FINISHED"
        self.export_steps = export_steps


def terminate_by_exit():
    """SIGTERM raises `SystemExit(128 + 15)` in the main thread; returns the previous handler
    (None off the main thread, where signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def on_sigterm(signum, frame):
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, on_sigterm)


@contextlib.contextmanager
def run_lifecycle(spec, *, rank: int, checkpoint_root: Path,
                  close: Callable[[], None] = lambda: None) -> Iterator[Lifecycle]:
    """Run the body as one rank's run of `spec` (see the module docstring). `close` releases what
    the rank built (rollout engines, reward workers); `checkpoint_root` holds the `actor/`
    checkpoints the export reads."""
    from mrl.platform import teardown

    from mrl.checkpoint.lock import hold_run_lock
    from mrl.tracking.tracker import run_dir_of

    life = Lifecycle()
    previous = terminate_by_exit()
    lock = None
    try:
        lock = hold_run_lock(run_dir_of(spec), rank, checkpoint_dir=spec.checkpoint.dir)
        yield life
    except (KeyboardInterrupt, SystemExit):   # Ctrl-C, or SIGTERM from torchrun, Slurm or kill
        life.status = "KILLED"
        raise
    except BaseException:
        life.status = "FAILED"
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if life.tracker is not None:
            life.tracker.finish(life.status)
        try:
            close()
            teardown()
            if life.status == "FINISHED" and spec.checkpoint.save_hf_at_end and life.export_steps is not None:
                from mrl.train.export import export_hf

                export_hf(spec, checkpoint_root, life.export_steps, rank=rank)
        finally:
            if lock is not None:
                lock.release()
