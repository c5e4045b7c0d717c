"""`mrl compare` end to end: select runs, diff their specs, summarise and plot metrics, print tables."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from rich.console import Console
from rich.table import Table

from mrl.compare.data import Point, history, metric_keys, run_params, spec_diff
from mrl.compare.metrics import Summary, expand, fmt, parse_choice, summarize
from mrl.compare.plot import write_plots
from mrl.compare.select import RunRef, Stores, select_runs

BEST_RULE = "best = max for rewards/accuracy, min for losses/KL/mismatch; '-' where neither applies"


@dataclass
class Comparison:
    """Everything `mrl compare` printed, for callers and tests."""

    runs: list[RunRef]
    diff: list[tuple[str, list[Optional[str]]]]  # (dotted key, value per run), only keys that differ
    same: int                                    # number of keys equal in every run
    metrics: list[str]                           # metric keys compared, in display order
    not_logged: list[str]                        # group members no run logged (e.g. kl/* without a KL loss)
    histories: dict[str, dict[str, list[Point]]] = field(default_factory=dict)  # key -> run label -> points
    summaries: dict[str, dict[str, Summary]] = field(default_factory=dict)     # key -> run label -> summary
    plots: list[Path] = field(default_factory=list)


def _console() -> Console:
    # Wide when piped (logs, CI, tests) so that tables do not wrap values; the terminal's width otherwise.
    return Console() if sys.stdout.isatty() else Console(width=200)


# Keys that differ between any two runs without saying how they differ as experiments.
_IDENTITY_KEYS = ("job.name", "job.description", "job.output_dir", "tracking.run_name", "tracking.tracking_uri",
                  "checkpoint.dir", "checkpoint.load_from")
MAX_LABEL_KEYS = 3


def curve_labels(runs: Sequence[RunRef], diff: Sequence[tuple[str, list[Optional[str]]]]) -> dict[str, str]:
    """Run label -> plot legend: the run's label and its values of the (first three) spec keys that
    differ between the runs, e.g. "b: actor.optim.lr=0.001" (unset keys are left out)."""
    keys = [(i, k) for i, (k, _) in enumerate(diff) if k not in _IDENTITY_KEYS and not k.startswith("data/")]
    shown = keys[:MAX_LABEL_KEYS]
    out = {}
    for j, r in enumerate(runs):
        parts = [f"{k}={diff[i][1][j]}" for i, k in shown if diff[i][1][j] is not None]
        if len(keys) > MAX_LABEL_KEYS:
            parts.append("...")
        out[r.label] = f"{r.label}: {', '.join(parts)}" if parts else r.label
    return out


def _show_value(value: Optional[str]) -> str:
    return "(unset)" if value is None else value


def compare(selectors: Sequence[str], *, tracking_uris: Sequence[str] = (), metrics: Optional[str] = None,
            out: Optional[str | Path] = None, console: Optional[Console] = None) -> Comparison:
    """Compare the runs `selectors` name (see `mrl.compare.select`); print tables; write PNGs to `out`."""
    console = console or _console()
    choices = parse_choice(metrics)  # a bad --metrics fails before any store is opened
    stores = Stores()
    runs = select_runs(selectors, tracking_uris, stores=stores)
    params = [run_params(stores, r) for r in runs]
    diff, same = spec_diff(params)
    logged = set().union(*(metric_keys(stores, r) for r in runs))
    keys, not_logged = expand(choices, logged)
    result = Comparison(runs, diff, same, keys, not_logged)
    for key in keys:
        result.histories[key] = {r.label: history(stores, r, key) for r in runs}
        result.summaries[key] = {label: summarize(key, pts) for label, pts in result.histories[key].items()}

    console.print("runs", style="bold")
    console.print(_runs_table(result))
    console.print(_diff_heading(result), style="bold", highlight=False)
    if result.diff:
        console.print(_diff_table(result))
    if keys:
        console.print("metrics: final and best (value @step)", style="bold")
        console.print(_metrics_table(result))
    if not_logged:
        console.print(f"not logged by any run: {', '.join(not_logged)}", style="dim", highlight=False)
    if out is not None and keys:
        legend = curve_labels(runs, diff)
        result.plots = write_plots(out, {key: {legend[label]: pts for label, pts in per_run.items()}
                                         for key, per_run in result.histories.items()})
        console.print(f"wrote {len(result.plots)} plot(s) to {out}: "
                      + ", ".join(p.name for p in result.plots), highlight=False, soft_wrap=True)
    return result


def _runs_table(c: Comparison) -> Table:
    t = Table("run", "run id", "experiment", "status", "last step", "store")
    for r in c.runs:
        last = max((pts[-1].step for h in c.histories.values() for label, pts in h.items()
                    if label == r.label and pts), default=None)
        t.add_row(r.label, r.run_id, r.experiment, r.status, "-" if last is None else str(last), r.tracking_uri)
    return t


def _diff_heading(c: Comparison) -> str:
    if len(c.runs) == 1:
        return f"spec and params: {c.same} keys (one run, nothing to compare)"
    if not c.diff:
        return f"spec and params: all {c.same} keys identical"
    return f"spec and params: {len(c.diff)} differ, {c.same} identical"


def _diff_table(c: Comparison) -> Table:
    t = Table("key", *(r.label for r in c.runs))
    for key, values in c.diff:
        t.add_row(key, *(_show_value(v) for v in values))
    return t


def _metrics_table(c: Comparison) -> Table:
    t = Table("metric", "best is", caption=BEST_RULE, caption_justify="left")
    for r in c.runs:
        t.add_column(f"{r.label} final", justify="right")
        t.add_column(f"{r.label} best", justify="right")
    for key in c.metrics:
        row = c.summaries[key]
        modes = {s.mode for s in row.values()}
        cells = []
        for r in c.runs:
            s = row[r.label]
            cells += [fmt(s.final), fmt(s.best) if s.mode else "-"]
        t.add_row(key, next(iter(modes)) or "-", *cells)
    return t
