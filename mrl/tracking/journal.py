"""Tracker writes that cannot kill training: retried with backoff, then dropped, counted, and
kept in the run directory to replay.

An MLflow store another writer holds locked for a few seconds, a read-only store or a network
store that is down must not end a run that trains fine: `WriteGuard.write` retries a failed
write with exponential backoff for up to `retry_s`, then drops it with a warning that counts
the writes dropped so far, and appends it to `<run dir>/tracking_dropped.jsonl` (one JSON
object per write). After a drop the next writes are tried once each (no backoff) until one
succeeds, so a store that stays broken costs each step one failed call, not `retry_s`.

`replay(run_dir)` (`mrl track replay RUN_DIR`) writes the journal's records into the store
once it works again and renames the journal `tracking_dropped.replayed.<n>.jsonl`.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

log = logging.getLogger(__name__)

JOURNAL = "tracking_dropped.jsonl"
RETRY_S = 30.0          # how long one write is retried before it is dropped
FIRST_DELAY_S = 0.25    # backoff: 0.25, 0.5, 1, 2, 4, 8, 8, ... seconds between tries
MAX_DELAY_S = 8.0


def _first_line(e: BaseException) -> str:
    """The line of `e` that says what failed (SQLAlchemy puts a note about autoflush first)."""
    text = [line for line in str(e).strip().splitlines() if line.strip() and not line.startswith("(raised as")]
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


class WriteGuard:
    """Runs tracker writes; a write that still fails after `retry_s` is dropped into the journal."""

    def __init__(self, run_dir: str | os.PathLike, *, retry_s: Optional[float] = None, first_delay_s: float = FIRST_DELAY_S,
                 say: Callable[[str], None] | None = None, sleep: Callable[[float], None] = time.sleep):
        self.journal = Path(run_dir) / JOURNAL
        self.retry_s = RETRY_S if retry_s is None else retry_s
        self.first_delay_s = first_delay_s
        self.dropped_writes = 0        # writes given up on (each is a line of the journal)
        self.retried_writes = 0        # writes that failed at least once and then succeeded
        self._say = say or log.warning
        self._sleep = sleep
        self._degraded = False         # the last write was dropped: try the next ones once each

    def drop(self, what: str, record: Optional[Mapping[str, Any]], error: str = "no MLflow run") -> bool:
        """Count `what` as dropped without trying it (there is nothing to write to); False."""
        self._dropped(what, record, f"not tried: {error}")
        return False

    def write(self, what: str, fn: Callable[[], Any], record: Optional[Mapping[str, Any]]) -> bool:
        """Run `fn` (the write `what`, e.g. "metrics of step 3"); True when it succeeded. On failure
        it is retried with backoff for `retry_s` (once when the store failed last time), then
        dropped: `record` (plain JSON data that `replay` can write) goes to the journal."""
        budget = 0.0 if self._degraded else self.retry_s
        started = time.monotonic()
        delay, tries = self.first_delay_s, 0
        while True:
            tries += 1
            try:
                fn()
            except Exception as e:   # noqa: BLE001 - any tracker failure; the step must go on
                error = e
            else:
                if tries > 1:
                    self.retried_writes += 1
                if self._degraded:
                    self._say("tracking: the store accepts writes again")
                self._degraded = False
                return True
            if time.monotonic() - started + delay > budget:
                break
            self._sleep(delay)
            delay = min(delay * 2, MAX_DELAY_S)
        self._degraded = True
        self._dropped(what, record, f"{tries} tr{'y' if tries == 1 else 'ies'} over "
                                    f"{time.monotonic() - started:.0f} s, {_first_line(error)}")
        return False

    def _dropped(self, what: str, record: Optional[Mapping[str, Any]], why: str) -> None:
        self.dropped_writes += 1
        kept = self._keep(record)
        if self.dropped_writes & (self.dropped_writes - 1) == 0:   # the 1st, 2nd, 4th, 8th ... drop
            self._say(f"tracking: {what} not written ({why}); dropped ({self.dropped_writes} write(s) dropped so far"
                      + (f", kept in {self.journal} for `mrl track replay {self.journal.parent}`)" if kept
                         else "; the run directory is not writable either: they are lost)"))

    def _keep(self, record: Optional[Mapping[str, Any]]) -> bool:
        if record is None:
            return True
        try:
            self.journal.parent.mkdir(parents=True, exist_ok=True)
            with open(self.journal, "a") as f:
                f.write(json.dumps(dict(record), default=str) + "\n")
            return True
        except OSError:
            return False


@dataclass
class ReplayReport:
    written: int
    failed: int
    journal: Optional[Path]    # where the replayed journal went (None: nothing to replay)

    def summary(self) -> str:
        if self.journal is None:
            return "nothing to replay"
        return (f"replayed {self.written} tracking write(s)" + (f", {self.failed} failed again" if self.failed else "")
                + f"; the journal is now {self.journal}")


def replay(run_dir: str | os.PathLike, tracking_uri: Optional[str] = None) -> ReplayReport:
    """Write the records of `<run_dir>/tracking_dropped.jsonl` into their MLflow runs (records of a
    run that never started, or that `tracking_uri`'s store does not hold, go into a new run of the
    same experiment and name). Records that fail
    again stay in a new journal; the replayed one is renamed."""
    from mrl.errors import UserError
    from mrl.tracking.mlflow_run import MlflowRun

    journal = Path(run_dir) / JOURNAL
    if not journal.is_file():
        if not Path(run_dir).is_dir():
            raise UserError(f"{run_dir}: no such run directory")
        return ReplayReport(0, 0, None)
    records = []
    for n, line in enumerate(journal.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("%s:%d: not a JSON record (a write cut short); skipped", journal, n)
    runs: dict[tuple, MlflowRun] = {}
    written, failed = 0, []
    for rec in records:
        uri = tracking_uri or rec["tracking_uri"]
        key = (uri, rec.get("run_id") or f"new:{rec['experiment']}:{rec['run_name']}")
        try:
            if key not in runs:
                runs[key] = _target_run(uri, rec)
            _apply(runs[key], rec)
            written += 1
        except Exception as e:   # noqa: BLE001 - reported and kept for a later replay
            log.warning("replay: %s failed again (%s)", rec.get("op"), _first_line(e))
            failed.append(rec)
    n = 1
    while (done := journal.with_name(f"tracking_dropped.replayed.{n}.jsonl")).exists():
        n += 1
    journal.rename(done)
    if failed:
        journal.write_text("".join(json.dumps(r) + "\n" for r in failed))
    return ReplayReport(written, len(failed), done)


def _target_run(uri: str, rec: Mapping[str, Any]):
    """The MLflow run a record goes to: its own run; a new run of its experiment and name when it
    has none, or when the store does not hold it (a replay into another store, `--tracking-uri`),
    tagged `mrl.replayed_from_run_id`."""
    from mrl.errors import UserError
    from mrl.tracking.mlflow_run import MlflowRun, ensure_store_dir

    ensure_store_dir(uri)   # a fresh local store: MLflow creates the file, not its directory
    run_id = rec.get("run_id")
    try:
        return MlflowRun(uri, rec["experiment"], rec["run_name"], run_id=run_id, tags={})
    except UserError:
        log.warning("replay: run %s is not in %s; its records go to a new run %r there", run_id, uri, rec["run_name"])
        return MlflowRun(uri, rec["experiment"], rec["run_name"], tags={"mrl.replayed_from_run_id": str(run_id)})


def _apply(run, rec: Mapping[str, Any]) -> None:
    op = rec["op"]
    if op == "metrics":
        run.log_metrics(rec["values"], int(rec["step"]), timestamp_ms=rec.get("time_ms"))
    elif op == "params":
        run.log_params(rec["values"])
    elif op in ("tags", "start"):
        run.set_tags(rec["values"])
    elif op == "text":
        run.log_text(rec["text"], rec["artifact"])
    elif op == "table":
        run.log_table(rec["columns"], rec["artifact"])
    elif op == "forget_after":
        run.forget_steps_after(int(rec["step"]))
    elif op == "finish":
        run.finish(rec["status"])
    else:
        raise ValueError(f"unknown journal record {op!r}")
