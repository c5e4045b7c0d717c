"""Benchmark full vs delta weight sync, side by side in one run, on real training steps.

    python tools/bench/weight_sync.py                      # CPU quickstart, 1 rank, bf16, 20 steps
    python tools/bench/weight_sync.py --steps 10 --lr 3e-3 1e-5
    python tools/bench/weight_sync.py --model ~/.cache/mrl/models/SmolLM2-135M-Instruct   # tools/models/smollm2.py

For each learning rate, trains the job twice in this process (`mrl.train.loop.train`): with
`rollout.weight_sync.mode = "full"` and with `"delta"`, both verifying the engine's weights
against the trainer's after every sync (`verify_every_steps = 1`), and reads the runs' `weight_sync/*`
metrics and `time/weight_sync` back from their MLflow stores. Prints, per mode, the mean over the
steps after the first (the first sync is full in both modes):

- MB sent per sync, and the fraction of elements whose bf16 bits changed since the last sync;
- time per sync (the `weight_sync` stage: export, compare, checksums, load);
- the per-bucket checksum time and the full-verification time inside it.

The learning rate decides how many bf16 elements change per step: the quickstart's 3e-3 moves
almost all of them, RL fine-tuning rates (1e-6 .. 1e-5) few. `--json PATH` writes the figures.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
REPO = Path(__file__).resolve().parents[2]


def _history(db: Path) -> dict[str, dict[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    [run] = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    return {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)} for k in run.data.metrics}


def _run(job: str, out: Path, overrides: list[str]) -> dict[str, dict[int, float]]:
    from mrl.config.loader import load
    from mrl.train.loop import train

    spec, _ = load(job, [f"job.output_dir={out}", "job.name=bench", 'tracking.backends=["mlflow"]', *overrides])
    train(spec)
    return _history(out / "mlflow.db")


def summarize(h: dict[str, dict[int, float]]) -> dict[str, float]:
    """Means over the steps after the first of one run's history."""
    steps = sorted(h["weight_sync/bytes"])[1:]

    def mean(key: str) -> float:
        return statistics.fmean(h[key][s] for s in steps)

    changed = mean("weight_sync/changed_fraction") if "weight_sync/changed_fraction" in h else None
    return {"MB_per_sync": mean("weight_sync/bytes") / 1e6, "MB_full": mean("weight_sync/bytes_full") / 1e6,
            "changed_fraction": changed, "sync_s": mean("time/weight_sync"),
            "checksum_s": mean("time/weight_sync_checksum"), "verify_s": mean("time/weight_sync_verify"),
            "full_syncs": sum(h["weight_sync/full"].values()), "steps": len(steps) + 1}


def _pct(x) -> str:
    return "-" if x is None else f"{x:.2%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", default=str(REPO / "jobs/quickstart_cpu.toml"))
    ap.add_argument("--model", default=None, help="model.path override (e.g. a local SmolLM2-135M directory)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, nargs="+", default=[3e-3, 1e-5])
    ap.add_argument("--json", metavar="PATH", default=None)
    a = ap.parse_args()
    base = ["platform.ranks_per_node=1", "parallel.tensor=1", "model.dtype=bfloat16", f"trainer.total_steps={a.steps}",
            "checkpoint.every_steps=0", "rollout.weight_sync.verify_every_steps=1"]
    if a.model:
        base.append(f"model.path={a.model}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for lr in a.lr:
            for mode in ("full", "delta"):
                out = Path(tmp) / f"{mode}_{lr:g}"
                h = _run(a.job, out, base + [f"actor.optim.lr={lr}", f"rollout.weight_sync.mode={mode}"])
                results[f"{mode} lr={lr:g}"] = summarize(h)
    print(f"{Path(a.job).name} ({a.model or 'its model'}), bf16, {a.steps} steps, 1 rank; means over steps 2..{a.steps}")
    print(f"{'run':<16} {'MB/sync':>9} {'of full':>8} {'changed':>8} {'sync s':>8} {'checksum s':>11} {'verify s':>9} "
          f"{'full syncs':>10}")
    for name, r in results.items():
        print(f"{name:<16} {r['MB_per_sync']:>9.3f} {r['MB_per_sync'] / r['MB_full']:>8.1%} {_pct(r['changed_fraction']):>8} "
              f"{r['sync_s']:>8.4f} {r['checksum_s']:>11.4f} {r['verify_s']:>9.4f} {int(r['full_syncs']):>10}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
