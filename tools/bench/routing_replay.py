"""Routing agreement and train/rollout mismatch of the tiny-MoE quickstart with and without
routing replay, side by side.

    python tools/bench/routing_replay.py                       # CPU (gloo), 2 ranks, ~2.5 min a run
    python tools/bench/routing_replay.py --modes off r3 --dtypes bfloat16 --steps 20

Runs jobs/quickstart_moe_cpu.toml (tiny random Qwen3-MoE, 4 experts top 2, EP 2, hf engine,
GRPO on the digits task) once per (`--dtypes`, `--modes`) pair, each launched as
`python -m torch.distributed.run --nproc_per_node 2 -m mrl train ...` with
`actor.moe.routing_replay = <mode>`, and reads every step's metrics back from the run's MLflow
store. Per run it prints, over the `--steps` steps:
- agreement: `moe/routing_agreement` (the share of tokens whose trainer top-k equals the rollout
  engine's, mean over MoE layers; the trainer's own top-k, computed even when it replays), its
  step-1 value, its mean and the lowest `moe/routing_agreement_min` (the worst layer) of any step;
- mismatch: `rollout/logprob_abs_diff_mean` / `_max` (|trainer - engine| log-prob of the same
  tokens, from the pass that gives the old log-probs: replayed under r3, the trainer's own
  routing under off and r2), step 1 and mean over steps, and `rollout/kl_k3`;
- reward: `reward/mean` at step 1 and over the last 3 steps.
Figures are printed, never asserted (`tests/engine/test_routing.py` checks the summary on a fake
history; the runs themselves are too long for a smoke test, as with `async_overlap.py`).
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
JOB = "jobs/quickstart_moe_cpu.toml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out: Path, mode: str, dtype: str, steps: int) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "mrl", "train", JOB, f"job.output_dir={out}", "job.name=run",
           'tracking.backends=["mlflow"]', f"trainer.total_steps={steps}", "checkpoint.every_steps=0",
           "checkpoint.save_hf_at_end=false", f"actor.moe.routing_replay={mode}", f"model.dtype={dtype}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{mode}/{dtype} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


def history(out: Path) -> dict[str, dict[int, float]]:
    """metric -> {step: value} of the one run in `out`/mlflow.db."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlflow.db').resolve()}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    run = runs[0].info.run_id
    return {k: {m.step: m.value for m in client.get_metric_history(run, k)} for k in runs[0].data.metrics}


def summarize(h: dict[str, dict[int, float]]) -> dict[str, float]:
    """The printed figures of one run from its per-step metrics."""
    def series(key):
        return [h[key][s] for s in sorted(h.get(key, {}))]

    def mean(xs):
        return sum(xs) / len(xs) if xs else float("nan")

    agree, worst = series("moe/routing_agreement"), series("moe/routing_agreement_min")
    diff_mean, diff_max = series("rollout/logprob_abs_diff_mean"), series("rollout/logprob_abs_diff_max")
    reward = series("reward/mean")
    return {"agreement_step1": agree[0] if agree else float("nan"), "agreement_mean": mean(agree),
            "agreement_min": min(worst) if worst else float("nan"),
            "diff_mean_step1": diff_mean[0] if diff_mean else float("nan"), "diff_mean": mean(diff_mean),
            "diff_max": max(diff_max) if diff_max else float("nan"), "kl_k3": mean(series("rollout/kl_k3")),
            "reward_step1": reward[0] if reward else float("nan"), "reward_last3": mean(reward[-3:])}


COLUMNS = [("agreement_step1", "agree@1", ".4f"), ("agreement_mean", "agree mean", ".4f"),
           ("agreement_min", "agree min", ".4f"), ("diff_mean_step1", "|dlogp|@1", ".2e"),
           ("diff_mean", "|dlogp| mean", ".2e"), ("diff_max", "|dlogp| max", ".2e"), ("kl_k3", "kl_k3", ".2e"),
           ("reward_step1", "reward@1", ".3f"), ("reward_last3", "reward last3", ".3f")]


def table(rows: list[tuple[str, str, dict]]) -> str:
    head = f"{'dtype':<9} {'replay':<6} " + " ".join(f"{title:>12}" for _, title, _ in COLUMNS)
    lines = [head, "-" * len(head)]
    for dtype, mode, r in rows:
        lines.append(f"{dtype:<9} {mode:<6} " + " ".join(f"{r[key]:>12{fmt}}" for key, _, fmt in COLUMNS))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=["off", "r2", "r3"], choices=["off", "r2", "r3"])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None, help="keep the runs here (default: a temporary directory)")
    a = ap.parse_args()
    root = Path(a.out or tempfile.mkdtemp(prefix="mrl-routing-replay-"))
    rows = []
    for dtype in a.dtypes:
        for mode in a.modes:
            out = root / f"{dtype}-{mode}"
            launch(out, mode, dtype, a.steps)
            rows.append((dtype, mode, summarize(history(out))))
            print(f"done {dtype} {mode}", flush=True)
    print(f"\ntiny-qwen3-moe quickstart, EP 2, hf engine, {a.steps} steps (runs in {root})")
    print(table(rows))


if __name__ == "__main__":
    main()
