"""Which runs `mrl compare` means: arguments resolved to MLflow runs in one or more stores.

An argument is
- an output directory (`job.output_dir`, holding the shared `mlflow.db` of its runs) or a `.db`
  file: every run in that store;
- a run directory (`<job.output_dir>/<job.name>`): the runs of that name in the output
  directory's store (usually one: a resumed job continues its run); a run directory holding its
  own `mlflow.db` (older layout) means every run in it;
- otherwise a run id, a run name or an experiment name (all its runs), looked up in the stores
  given with `--tracking-uri` (URIs, output or run directories, `.db` files), else in
  `$MLFLOW_TRACKING_URI`, else in `runs/mlflow.db` and every `runs/*/mlflow.db` under the working
  directory (the default `job.output_dir`).
"""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Iterable, Sequence

from mrl.errors import UserError

STORE_FILE = "mlflow.db"
DEFAULT_OUTPUT_DIR = "runs"  # job.output_dir's default
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


@dataclasses.dataclass(frozen=True)
class RunRef:
    """One MLflow run and the store it lives in."""

    tracking_uri: str
    run_id: str
    name: str
    experiment: str
    status: str
    label: str = ""  # unique display name, set by `label_runs`


def store_of_path(arg: str | os.PathLike) -> str | None:
    """`sqlite:///<abs>/mlflow.db` for a run directory or a `.db` file, None when `arg` is neither."""
    p = Path(arg)
    if p.is_dir() and (p / STORE_FILE).is_file():
        return f"sqlite:///{(p / STORE_FILE).resolve()}"
    if p.is_file() and p.suffix == ".db":
        return f"sqlite:///{p.resolve()}"
    return None


def run_dir_store(arg: str | os.PathLike) -> tuple[str, str] | None:
    """(the output directory's store, the run name) for a run directory `<job.output_dir>/<job.name>`
    whose runs live in the shared store one level up; None otherwise."""
    p = Path(arg)
    if p.is_dir() and not (p / STORE_FILE).is_file() and (p.resolve().parent / STORE_FILE).is_file():
        return f"sqlite:///{(p.resolve().parent / STORE_FILE)}", p.resolve().name
    return None


def tracking_uri_of(value: str) -> str:
    """A `--tracking-uri` value as an MLflow URI: run directories and `.db` files are discovered."""
    found = store_of_path(value)
    if found is not None:
        return found
    shared = run_dir_store(value)
    if shared is not None:
        return shared[0]
    if value.startswith("sqlite:///"):
        if not Path(value[len("sqlite:///"):]).is_file():
            raise UserError(f"--tracking-uri {value}: no such sqlite file")
        return value
    if "://" in value or value.startswith(("databricks", "file:")):
        return value
    if Path(value).is_dir():
        raise UserError(f"--tracking-uri {value}: no {STORE_FILE} in this directory "
                        f"(a run's store is <job.output_dir>/{STORE_FILE})")
    raise UserError(f"--tracking-uri {value}: not a tracking URI, a run directory or a .db file")


def default_stores(cwd: str | os.PathLike = ".") -> list[str]:
    """`$MLFLOW_TRACKING_URI` if set, else `runs/mlflow.db` and every `runs/*/mlflow.db` under `cwd`."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return [tracking_uri_of(env)]
    out = Path(cwd, DEFAULT_OUTPUT_DIR)
    dbs = [out / STORE_FILE] if (out / STORE_FILE).is_file() else []
    return [f"sqlite:///{db.resolve()}" for db in dbs + sorted(out.glob(f"*/{STORE_FILE}"))]


class Stores:
    """One `MlflowClient` per tracking URI, created on first use (opening a store costs seconds)."""

    def __init__(self):
        self._clients: dict = {}

    def client(self, uri: str):
        if uri not in self._clients:
            from mlflow.tracking import MlflowClient

            self._clients[uri] = MlflowClient(tracking_uri=uri)
        return self._clients[uri]

    def _ref(self, uri: str, run, experiment_names: dict[str, str]) -> RunRef:
        exp_id = run.info.experiment_id
        if exp_id not in experiment_names:
            experiment_names[exp_id] = self.client(uri).get_experiment(exp_id).name
        return RunRef(uri, run.info.run_id, run.info.run_name or run.info.run_id, experiment_names[exp_id],
                      run.info.status)

    def all_runs(self, uri: str) -> list[RunRef]:
        """Every active run in the store, oldest first."""
        client = self.client(uri)
        exps = client.search_experiments()
        names = {e.experiment_id: e.name for e in exps}
        runs = client.search_runs([e.experiment_id for e in exps], order_by=["attributes.start_time ASC"]) if exps else []
        return [self._ref(uri, r, names) for r in runs]

    def find(self, uri: str, selector: str) -> list[RunRef]:
        """Runs in one store matching `selector`: a run id, else a run name, else an experiment name."""
        from mlflow.exceptions import MlflowException

        client = self.client(uri)
        names: dict[str, str] = {}
        if _RUN_ID.match(selector):
            try:
                return [self._ref(uri, client.get_run(selector), names)]
            except MlflowException:
                pass
        exps = client.search_experiments()
        if not exps:
            return []
        names.update({e.experiment_id: e.name for e in exps})
        quoted = selector.replace("\\", "\\\\").replace("'", "\\'")
        runs = client.search_runs([e.experiment_id for e in exps], filter_string=f"attributes.run_name = '{quoted}'",
                                  order_by=["attributes.start_time ASC"])
        if not runs:
            exp = next((e for e in exps if e.name == selector), None)
            if exp is not None:
                runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
        return [self._ref(uri, r, names) for r in runs]


def label_runs(runs: Sequence[RunRef]) -> list[RunRef]:
    """Give every run a unique label: its name, or `name#<id prefix>` where names repeat."""
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.name] = counts.get(r.name, 0) + 1
    return [dataclasses.replace(r, label=r.name if counts[r.name] == 1 else f"{r.name}#{r.run_id[:6]}") for r in runs]


def select_runs(args: Iterable[str], tracking_uris: Sequence[str] = (), *, stores: Stores | None = None,
                cwd: str | os.PathLike = ".") -> list[RunRef]:
    """The runs that `args` name, in argument order, each once, labelled."""
    args = list(args)
    if not args:
        raise UserError("mrl compare: name at least one run, experiment or run directory")
    stores = stores or Stores()
    search = [tracking_uri_of(u) for u in tracking_uris] if tracking_uris else None
    found: list[RunRef] = []
    for arg in args:
        uri = store_of_path(arg)
        shared = run_dir_store(arg) if uri is None else None
        if uri is not None:
            runs = stores.all_runs(uri)
            if not runs:
                raise UserError(f"{arg}: its {STORE_FILE} holds no runs")
        elif shared is not None:
            runs = stores.find(*shared)
            if not runs:
                raise UserError(f"{arg}: no run named {shared[1]!r} in {shared[0]}")
        else:
            if search is None:
                search = default_stores(cwd)
                if not search:
                    raise UserError(f"{arg}: not a run directory, and no store to look it up in "
                                    f"(no --tracking-uri, no $MLFLOW_TRACKING_URI, no "
                                    f"{DEFAULT_OUTPUT_DIR}/{STORE_FILE} here)")
            runs = [r for u in search for r in stores.find(u, arg)]
            if not runs:
                where = ", ".join(search) if len(search) <= 3 else f"{len(search)} stores ({search[0]}, ...)"
                hint = f" ({arg} exists but holds no {STORE_FILE})" if Path(arg).exists() else ""
                raise UserError(f"{arg}: no run id, run name or experiment of that name in {where}{hint}")
        found.extend(runs)
    unique = list({(r.tracking_uri, r.run_id): r for r in found}.values())
    return label_runs(unique)
