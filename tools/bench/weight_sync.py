"""Benchmark full vs delta weight sync, side by side in one run, on real training steps.

    python tools/bench/weight_sync.py                          # CPU quickstart and SmolLM2-135M, bf16, 20 steps
    python tools/bench/weight_sync.py --cases quickstart --steps 10 --lr 3e-3 1e-5
    python tools/bench/weight_sync.py --cases smollm2 --model ~/.cache/mrl/models/SmolLM2-135M-Instruct
    python tools/bench/weight_sync.py --cases quickstart --separate   # also across the bridge (torchrun, 2 ranks)
    python tools/bench/weight_sync.py --cases quickstart --fp8        # also with block-FP8 rollout weights

Cases (each with its learning rates; `--lr` overrides them all):
- `quickstart`: jobs/quickstart_cpu.toml, its tiny Qwen2 (0.72 MB in bf16), lr 3e-3 (the job's) and 1e-5, 1e-6;
- `smollm2`: jobs/smollm2_chainsum_cpu.toml on the real SmolLM2-135M-Instruct (`--model`, the directory
  `tools/models/smollm2.py` builds; 269 MB in bf16), lr 2e-5 (the job's) and 1e-6, with a smaller
  batch than the job's (4 prompts x 4 responses: the sync does not depend on it, and a step takes
  seconds instead of a minute on 2 CPU cores). A step whose groups all score alike has zero
  advantages and moves no weight: the mean reward and gradient norm are printed with the figures.

For each case and learning rate, trains the job twice in this process (`mrl.train.loop.train`, 1
rank, bf16): with `rollout.weight_sync.mode = "full"` and with `"delta"`, both verifying the
engine's weights against the trainer's after every sync (`verify_every_steps = 1`), and reads the
runs' `weight_sync/*` metrics and `time/weight_sync` back from their MLflow stores. Prints, per
run, the mean over the steps after the first (the first sync is full in both modes):

- MB sent per sync, its share of a full sync, and the fraction of elements whose bf16 bits changed;
- time per sync (the `weight_sync` stage: export, compare, checksums, load);
- the checksum time (sender and receiver) and the full-verification time inside it, and their
  share of the sync (the verification overhead).

`--separate` also runs the quickstart on separate rollout ranks (1 trainer + 1 rollout rank,
torchrun, on-policy), full vs delta: the MB that cross the bridge per sync and trainer rank 0's
time per sync (export, compare, checksums and broadcast; the rollout rank checks and loads it).

`--fp8` also runs every case with `rollout.quantization = "fp8"` (docs/fp8.md), full and delta, and
prints each run's bytes per sync as a share of the bf16 full sync of the same case and lr.

The learning rate decides how many bf16 elements change per step: the quickstart's 3e-3 moves
almost all of them, RL fine-tuning rates (1e-6 .. 1e-5) few. `--json PATH` writes the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
REPO = Path(__file__).resolve().parents[2]
SMOLLM2 = Path.home() / ".cache" / "mrl" / "models" / "SmolLM2-135M-Instruct"

# name -> (job, overrides, learning rates)
CASES = {
    "quickstart": ("jobs/quickstart_cpu.toml", ["parallel.tensor=1"], [3e-3, 1e-5, 1e-6]),
    "smollm2": ("jobs/smollm2_chainsum_cpu.toml",
                ["data.prompts_per_step=4", "rollout.responses_per_prompt=4", "actor.mini_batch_prompts=4",
                 "reward.workers=1"], [2e-5, 1e-6]),
}


def _history(db: Path) -> dict[str, dict[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    [run] = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    return {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)} for k in run.data.metrics}


def _run(job: str, out: Path, overrides: list[str]) -> dict[str, dict[int, float]]:
    from mrl.config.loader import load
    from mrl.train.loop import train

    spec, _ = load(str(REPO / job), [f"job.output_dir={out}", "job.name=bench", 'tracking.backends=["mlflow"]',
                                     *overrides])
    train(spec)
    return _history(out / "mlflow.db")


def _run_separate(out: Path, overrides: list[str]) -> dict[str, dict[int, float]]:
    """The quickstart on 1 trainer + 1 rollout rank (torchrun)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), "-m", "mrl", "train", str(REPO / "jobs/quickstart_cpu.toml"),
           f"job.output_dir={out}", "job.name=bench", 'tracking.backends=["mlflow"]', "platform.ranks_per_node=2",
           "rollout.placement=separate", "rollout.ranks=1", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"separate run failed:\n{proc.stderr[-3000:]}")
    return _history(out / "mlflow.db")


def summarize(h: dict[str, dict[int, float]]) -> dict[str, float]:
    """Means over the steps after the first of one run's history (steps that synced)."""
    steps = sorted(h["weight_sync/bytes"])[1:]

    def mean(key: str) -> float:
        return statistics.fmean(h[key][s] for s in steps) if key in h else float("nan")

    changed = mean("weight_sync/changed_fraction") if "weight_sync/changed_fraction" in h else None
    return {"MB_per_sync": mean("weight_sync/bytes") / 1e6, "MB_full": mean("weight_sync/bytes_full") / 1e6,
            "changed_fraction": changed, "sync_s": mean("time/weight_sync"),
            "checksum_s": mean("time/weight_sync_checksum"), "verify_s": mean("time/weight_sync_verify"),
            "step_s": mean("time/step"), "reward_mean": mean("reward/mean"), "grad_norm": mean("actor/grad_norm_max"),
            "full_syncs": sum(h["weight_sync/full"].values()), "steps": len(steps) + 1}


def _pct(x) -> str:
    return "-" if x is None else f"{x:.2%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    ap.add_argument("--model", default=str(SMOLLM2), help="the SmolLM2-135M-Instruct directory (smollm2 case)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, nargs="+", default=None, help="learning rates (default: each case's)")
    ap.add_argument("--separate", action="store_true", help="also the quickstart across the bridge (torchrun)")
    ap.add_argument("--fp8", action="store_true", help="also with block-FP8 rollout weights (rollout.quantization)")
    ap.add_argument("--json", metavar="PATH", default=None)
    a = ap.parse_args()
    base = ["platform.ranks_per_node=1", "model.dtype=bfloat16", f"trainer.total_steps={a.steps}",
            "checkpoint.every_steps=0", "checkpoint.save_optimizer=false", "rollout.weight_sync.verify_every_steps=1"]
    if "smollm2" in a.cases and not (Path(a.model) / "config.json").is_file():
        sys.exit(f"no SmolLM2-135M at {a.model}: build it with tools/models/smollm2.py (or leave out --cases smollm2)")
    results, started = {}, time.time()
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for case in a.cases:
            job, overrides, lrs = CASES[case]
            extra = [f"model.path={Path(a.model).resolve()}"] if case == "smollm2" else []
            for lr in a.lr or lrs:
                for quant in ("", " fp8")[:1 + a.fp8]:
                    for mode in ("full", "delta"):
                        out = Path(tmp) / f"{case}_{mode}_{lr:g}{quant.strip()}"
                        h = _run(job, out, base + overrides + extra + [f"actor.optim.lr={lr}",
                                                                       f"rollout.weight_sync.mode={mode}"]
                                 + (['rollout.quantization="fp8"'] if quant else []))
                        r = results[f"{case} lr={lr:g}{quant} {mode}"] = summarize(h)
                        r["of_bf16"] = r["MB_per_sync"] / results[f"{case} lr={lr:g} full"]["MB_full"]
        if a.separate:
            for lr in a.lr or CASES["quickstart"][2]:
                for mode in ("full", "delta"):
                    out = Path(tmp) / f"separate_{mode}_{lr:g}"
                    h = _run_separate(out, [f"trainer.total_steps={a.steps}", "checkpoint.every_steps=0",
                                            "model.dtype=bfloat16", "parallel.tensor=1", f"actor.optim.lr={lr}",
                                            f"rollout.weight_sync.mode={mode}", "rollout.weight_sync.verify_every_steps=1"])
                    results[f"bridge lr={lr:g} {mode}"] = summarize(h)
    print(f"bf16, {a.steps} steps, 1 rank (bridge: 1 trainer + 1 rollout rank); means over steps 2..{a.steps}; "
          f"load average {load[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end, {time.time() - started:.0f} s")
    print(f"{'run':<28} {'MB/sync':>9} {'of full':>8} {'changed':>8} {'sync s':>8} {'checksum s':>11} {'verify s':>9} "
          f"{'(ck+vf)/sync':>12} {'step s':>7} {'full syncs':>10} {'reward':>7} {'grad norm':>9}"
          + (f" {'of bf16':>8}" if a.fp8 else ""))
    for name, r in results.items():
        overhead = (r["checksum_s"] + r["verify_s"]) / r["sync_s"] if r["sync_s"] else float("nan")
        print(f"{name:<28} {r['MB_per_sync']:>9.3f} {r['MB_per_sync'] / r['MB_full']:>8.1%} "
              f"{_pct(r['changed_fraction']):>8} {r['sync_s']:>8.4f} {r['checksum_s']:>11.4f} {r['verify_s']:>9.4f} "
              f"{overhead:>12.1%} {r['step_s']:>7.2f} {int(r['full_syncs']):>10} {r['reward_mean']:>7.3f} {r['grad_norm']:>9.3g}"
              + (f" {r.get('of_bf16', float('nan')):>8.1%}" if a.fp8 else ""))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
