"""What `mrl compare` reads from each run: its params (the resolved spec) and metric histories.

Trainer runs log the resolved spec twice (see `mrl.tracking.tracker.Tracker.log_spec`): as
dotted-key params, which MLflow truncates at 6000 characters, and as the `spec.toml` artifact.
The spec keys come from `spec.toml` when the run has it (exact values), and every other param
(e.g. the data loader's counts) from the params.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
import tomllib
from dataclasses import dataclass
from typing import Mapping, Sequence

from mrl.compare.select import RunRef, Stores
from mrl.tracking.params import flatten

SPEC_ARTIFACT = "spec.toml"


@dataclass(frozen=True)
class Point:
    step: int
    value: float


def run_params(stores: Stores, run: RunRef) -> dict[str, str]:
    """Every param of `run` as dotted key -> string, spec keys exact from `spec.toml` when logged."""
    client = stores.client(run.tracking_uri)
    params = dict(client.get_run(run.run_id).data.params)
    if any(a.path == SPEC_ARTIFACT for a in client.list_artifacts(run.run_id)):
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        with tempfile.TemporaryDirectory() as tmp:
            path = client.download_artifacts(run.run_id, SPEC_ARTIFACT, tmp)
            with open(path, "rb") as f:
                params.update(flatten(tomllib.load(f), limit=None))
    return params


def metric_keys(stores: Stores, run: RunRef) -> set[str]:
    """Names of every metric the run logged."""
    return set(stores.client(run.tracking_uri).get_run(run.run_id).data.metrics)


def history(stores: Stores, run: RunRef, key: str) -> list[Point]:
    """`key` by step, one point per step (the last logged when a step was logged twice, e.g. on resume)."""
    raw = stores.client(run.tracking_uri).get_metric_history(run.run_id, key)
    by_step: dict[int, tuple[int, float]] = {}
    for m in raw:
        if m.step not in by_step or m.timestamp >= by_step[m.step][0]:
            by_step[m.step] = (m.timestamp, m.value)
    return [Point(step, value) for step, (_, value) in sorted(by_step.items())]


def spec_diff(params: Sequence[Mapping[str, str]]) -> tuple[list[tuple[str, list[str | None]]], int]:
    """Keys whose values differ between runs (None where a run lacks the key), sorted; and how many agree."""
    keys = sorted(set().union(*params)) if params else []
    differ, same = [], 0
    for key in keys:
        values = [p.get(key) for p in params]
        if len(set(values)) > 1:
            differ.append((key, values))
        else:
            same += 1
    return differ, same


def finite(points: Sequence[Point]) -> list[Point]:
    return [p for p in points if not math.isnan(p.value)]
