"""Benchmark how much of the rollout a separate, one-step-off-policy placement hides behind training.

    python tools/bench/async_overlap.py                  # CPU (gloo), 3 ranks, about 5 minutes
    python tools/bench/async_overlap.py --reward-sleep-ms 60 --epochs 8 --steps 10
    python tools/bench/async_overlap.py --device cuda    # 3 GPUs (nccl); retune the knobs (below)

Runs the CPU quickstart job (jobs/quickstart_cpu.toml: tiny Qwen2, GRPO, digits task) three
ways on the same 3 ranks, one after the other, each launched as
`python -m torch.distributed.run --nproc_per_node 3 -m mrl train ...`:
  (a) colocated: every rank generates, scores and trains (parallel.tensor = 1, so DP 3);
  (b) separate, rollout.max_staleness = 0: 1 rollout rank + 2 trainer ranks (DP 2); on-policy,
      so the trainer waits for each step's rollouts and the rollout rank waits for each update;
  (c) separate, rollout.max_staleness = 1: the rollouts of step t + 1 are generated (with the
      weights of step t - 1) while step t trains.
The prompt batch (`--prompts`, default 12) and the optimizer mini-batch (`--mini-batch`, default
6) divide by 3 and by 2, so every layout splits them evenly; no dynamic sampling.

The slow rollout: the reward is the quickstart digits reward behind a fixed sleep per call
(tools/bench/slow_reward.py, `--reward-sleep-ms`, `--reward-workers` processes per scoring
rank). Scoring is part of the rollout stage, on the rollout rank in (b)/(c) and on every rank in
(a), so the sleep stands for a latency-bound verifier (a sandboxed code run, a remote judge). It
costs wall-clock time but no CPU, so rollout and training can genuinely overlap even on a
machine with fewer cores than ranks. The defaults (40 ms per call, 2 workers: 96 calls per step
on the rollout rank, about 1.9 s of sleep next to about 1 s of generation; `--epochs 6` passes
over each step's data, about 2-4 s of training on 2 CPU ranks) make the rollout and train columns
of (b) and (c) comparable on a small CPU machine. On other hardware (a GPU trains and generates
this tiny model in milliseconds) retune `--reward-sleep-ms` and `--epochs` until they are close.

Metrics are read back from each run's MLflow store (`<output>/mlflow.db`), averaged over the
steady-state steps (`--skip` first steps left out: start-up, first compilation, the first
separate step that has nothing to overlap with):
- step: the wall-clock period between consecutive steps' ends (`time/step_period`), which
  counts everything a step costs (weight broadcast, rollout transfer, logging), and its spread;
- time/step: the trainer's own step timer (wait/rollout + training stages);
- rollout: generation + scoring of one step, `time/rollout` (a) or `time/rollout_generate`
  measured on the rollout rank (b, c);
- train: `time/train` (log-probs, advantages, actor update);
- wait: `time/rollout_wait`, how long the trainer waited for the step's rollouts (b, c);
- lag: `rollout/version_lag_max` (0 in a and b, 1 in c after step 1).
Printed ratios:
- the overlap fraction (rollout + train - step) / min(rollout, train) of (b) and (c), each from
  its own run's stage times: the share of the largest possible saving that was achieved (1: step
  = max(rollout, train), 0: step = rollout + train);
- the same fraction for (c) against the sequential run, (step_b - step_c) / min(rollout_b,
  train_b), and how much each stage slowed down when overlapped (rollout_c / rollout_b, train_c /
  train_b): where cores are fewer than busy processes, generation and training overlapped share
  them and each gets slower, which the first fraction does not show;
- step (c) against max and sum of its stages, and the step ratios between the configurations.

On a shared CPU machine the figures are noisy: other processes take cores, the 3 ranks and their
reward workers share whatever cores there are, and the three runs happen one after another, so a
change in load between them moves the cross-run ratios (a fraction against (b) above 1 is such
noise). The `+-` column is the spread of the step period within a run. Compare the columns of
one run, and run it twice before drawing conclusions. OMP_NUM_THREADS is 1 for every rank.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
JOB = "jobs/quickstart_cpu.toml"
RANKS = 3
CONFIGS = {
    "a colocated": ["rollout.placement=colocated"],
    "b separate k=0": ["rollout.placement=separate", "rollout.ranks=1", "rollout.max_staleness=0"],
    "c separate k=1": ["rollout.placement=separate", "rollout.ranks=1", "rollout.max_staleness=1"],
}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def overrides(args, out: Path) -> list[str]:
    sleep_s = args.reward_sleep_ms / 1000
    return [f"job.output_dir={out}", "job.name=run", 'tracking.backends=["mlflow"]',
            f"platform.ranks_per_node={RANKS}", f"platform.device={args.device}", "parallel.tensor=1",
            f"data.prompts_per_step={args.prompts}", f"actor.mini_batch_prompts={args.mini_batch}",
            f"actor.epochs={args.epochs}", f"trainer.total_steps={args.steps}",
            "checkpoint.every_steps=0", "checkpoint.save_optimizer=false",
            "reward.function=tools/bench/slow_reward.py:score", f"reward.kwargs={{sleep_s={sleep_s}}}",
            f"reward.workers={args.reward_workers}", f"reward.timeout_s={max(5.0, 20 * sleep_s)}",
            *args.set]


def launch(args, name: str, extra: list[str], out: Path) -> float:
    """Train one configuration; returns the launch's wall-clock seconds."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(RANKS),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           "-m", "mrl", "train", JOB, *overrides(args, out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    print(f"[{name}] {' '.join(extra)}", flush=True)
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"[{name}] exited {proc.returncode}\n--- stdout\n{proc.stdout[-5000:]}\n--- stderr\n"
                 f"{proc.stderr[-5000:]}")
    return time.monotonic() - started


def history(out: Path) -> dict[str, dict[int, float]]:
    """metric -> {step: value} of the one run in `out`/mlflow.db."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlflow.db').resolve()}")
    [run] = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    return {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
            for key in run.data.metrics}


def summarize(h: dict[str, dict[int, float]], steps: list[int]) -> dict[str, float]:
    periods = [h["time/step_period"][s] for s in steps]
    rollout = h.get("time/rollout_generate") or h["time/rollout"]
    wait = h.get("time/rollout_wait")

    def mean(series):
        return statistics.fmean(series[s] for s in steps)

    return {"step": statistics.fmean(periods), "spread": statistics.pstdev(periods), "time/step": mean(h["time/step"]),
            "rollout": mean(rollout), "train": mean(h["time/train"]),
            "wait": mean(wait) if wait else float("nan"), "lag": max(h["rollout/version_lag_max"][s] for s in steps)}


def overlap(r: dict[str, float]) -> float:
    return (r["rollout"] + r["train"] - r["step"]) / min(r["rollout"], r["train"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="trainer.total_steps of each run")
    p.add_argument("--skip", type=int, default=2, help="first steps left out of the means")
    p.add_argument("--prompts", type=int, default=12, help="data.prompts_per_step (divisible by 3 and 2)")
    p.add_argument("--mini-batch", type=int, default=6, help="actor.mini_batch_prompts (divisible by 3 and 2)")
    p.add_argument("--epochs", type=int, default=6, help="actor.epochs: passes over each step's data")
    p.add_argument("--reward-sleep-ms", type=float, default=40.0, help="sleep per reward call")
    p.add_argument("--reward-workers", type=int, default=2, help="reward.workers per scoring rank")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override for every run")
    p.add_argument("--keep", metavar="DIR", help="write the runs under DIR and keep them (default: a temporary dir)")
    args = p.parse_args()
    if args.skip < 1 or args.steps <= args.skip:
        p.error("need 1 <= --skip < --steps")
    for flag, v in (("--prompts", args.prompts), ("--mini-batch", args.mini_batch)):
        if v % 6:
            p.error(f"{flag} must divide by 3 and by 2 (data-parallel 3 colocated, 2 separate)")

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="mrl-bench-overlap-"))
    steps = list(range(args.skip + 1, args.steps + 1))
    results, launches = {}, {}
    try:
        for name, extra in CONFIGS.items():
            out = root / name.split()[0]
            shutil.rmtree(out, ignore_errors=True)
            launches[name] = launch(args, name, extra, out)
            results[name] = summarize(history(out), steps)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    print(f"\nrollout/training overlap: {JOB} on {RANKS} ranks ({args.device}), parallel.tensor 1, "
          f"{args.prompts} prompts x 8 responses per step, mini-batch {args.mini_batch}, actor.epochs {args.epochs}, "
          f"reward sleep {args.reward_sleep_ms:g} ms x {args.reward_workers} workers; means over steps "
          f"{steps[0]}-{steps[-1]} (seconds)")
    print(f"  {'config':16s} {'step':>7s} {'+-':>6s} {'time/step':>9s} {'rollout':>8s} {'train':>7s} {'wait':>7s} "
          f"{'lag':>4s} {'launch':>7s}")
    for name, r in results.items():
        print(f"  {name:16s} {r['step']:7.3f} {r['spread']:6.3f} {r['time/step']:9.3f} {r['rollout']:8.3f} "
              f"{r['train']:7.3f} {r['wait']:7.3f} {r['lag']:4.0f} {launches[name]:7.1f}")
    a, b, c = results.values()
    print(f"  overlap fraction (rollout + train - step) / min(rollout, train), each run's own stages: "
          f"(b) {overlap(b):5.2f}   (c) {overlap(c):5.2f}")
    print(f"  overlap fraction of (c) against the sequential (b): (step_b - step_c) / min(rollout_b, train_b) = "
          f"{(b['step'] - c['step']) / min(b['rollout'], b['train']):5.2f}")
    print(f"  stage slowdown when overlapped (shared cores): "
          f"rollout_c / rollout_b {c['rollout'] / b['rollout']:5.2f}   train_c / train_b {c['train'] / b['train']:5.2f}")
    print(f"  step (c) / max(rollout_c, train_c) = {c['step'] / max(c['rollout'], c['train']):5.2f}   "
          f"step (c) / (rollout_c + train_c) = {c['step'] / (c['rollout'] + c['train']):5.2f}")
    print(f"  step ratios: (b)/(a) {b['step'] / a['step']:5.2f}   (c)/(a) {c['step'] / a['step']:5.2f}   "
          f"(c)/(b) {c['step'] / b['step']:5.2f}")

if __name__ == "__main__":
    main()
