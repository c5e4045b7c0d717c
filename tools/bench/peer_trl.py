"""The SmolLM2 GRPO job in mrl and in TRL's GRPOTrainer, side by side in one run.

    python tools/bench/peer_trl.py --steps 3                 # both, 3 steps each
    python tools/bench/peer_trl.py --steps 5 --json out.json
    python tools/bench/peer_trl.py --setup-only              # build TRL's venv and stop

mrl: jobs/smollm2_chainsum_cpu.toml as shipped (2 ranks through `mrl launch`, 8 prompts x 8
responses, 32 new tokens, GRPO, clip 0.2/0.28, token mean, no KL), `--steps` steps, no
checkpoint, its per-step `time/step` and `reward/mean` read back from the run's MLflow store.

TRL: `tools/bench/trl_grpo_runner.py` in a venv of its own (`--venv`, default
.mrl-cache/trl-venv), created here on first use from pinned versions: torch 2.13.0+cpu and
transformers, accelerate and numpy as mrl's constraints.txt pins them, trl 1.16.0, datasets
5.2.0, reasoning_gym 0.1.25. TRL is never installed into mrl's venv. Same model, data, prompt,
sampling, loss and batch (the runner's docstring lists them); one process using the machine's
cores (mrl uses them as 2 ranks).

Prints, for each, the mean seconds per step (all steps, and after the first, which carries
warm-up), the mean reward per step, and the ratio TRL / mrl (above 1: mrl is faster), with the load
average before and after: on a shared machine both slow down, unevenly, so compare on an idle one.
Then where a step goes on each side (generation, the policy update, mrl's weight sync, the rest)
and the ratio bound that follows: with mrl's rollout and sync taking no time, TRL / mrl would be
its step over mrl's update and the rest (the gap the update, the same arithmetic on both sides,
leaves).
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

REPO = Path(__file__).resolve().parents[2]
JOB = "jobs/smollm2_chainsum_cpu.toml"
TRL_PINS = ["trl==1.16.0", "datasets==5.2.0", "reasoning_gym==0.1.25"]
FROM_MRL_CONSTRAINTS = ("torch", "transformers", "accelerate", "numpy")


def default_model() -> Path:
    for d in (REPO / ".mrl-cache" / "models" / "SmolLM2-135M-Instruct",
              Path.home() / ".cache" / "mrl" / "models" / "SmolLM2-135M-Instruct"):
        if (d / "config.json").is_file():
            return d
    return REPO / ".mrl-cache" / "models" / "SmolLM2-135M-Instruct"


def pins() -> list[str]:
    """TRL's venv requirements: mrl's pins of the shared packages, then TRL's own."""
    found = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        name, _, version = line.strip().partition("==")
        if name.lower() in FROM_MRL_CONSTRAINTS and version:
            found[name.lower()] = f"{name}=={version}"
    missing = [n for n in FROM_MRL_CONSTRAINTS if n not in found]
    if missing:
        sys.exit(f"constraints.txt pins no {', '.join(missing)}")
    return [found[n] for n in FROM_MRL_CONSTRAINTS] + TRL_PINS


def ensure_venv(venv: Path) -> Path:
    """TRL's venv (created and installed when its marker does not list today's pins); its python."""
    python, marker = venv / "bin" / "python", venv / "mrl-peer-pins.txt"
    want = "\n".join(pins())
    if python.is_file() and marker.is_file() and marker.read_text() == want:
        return python
    print(f"peer_trl: building TRL's venv at {venv} ({', '.join(pins())})", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    torch_pin = next(p for p in pins() if p.startswith("torch=="))
    subprocess.run(pip + [torch_pin], check=True)   # first, so nothing reaches for a CUDA build
    subprocess.run(pip + pins(), check=True)
    marker.write_text(want)
    return python


def _history(db: Path) -> dict[str, dict[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    [run] = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    return {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)} for k in run.data.metrics}


def run_mrl(model: Path, steps: int, work: Path) -> dict:
    out = work / "mrl"
    cmd = [sys.executable, "-m", "mrl", "launch", "--run", "train", str(REPO / JOB), f"model.path={model}",
           f"trainer.total_steps={steps}", "checkpoint.every_steps=0", f"job.output_dir={out}", "job.name=peer",
           'tracking.backends=["mlflow"]']
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"peer_trl: the mrl run failed:\n{proc.stderr[-3000:]}")
    h = _history(out / "mlflow.db")
    stage = lambda key, s: h.get(key, {}).get(s, 0.0)   # noqa: E731
    return {"steps": [{"step": s, "seconds": h["time/step"][s], "reward": h.get("reward/mean", {}).get(s),
                       "generate": stage("time/rollout", s), "update": stage("time/actor_update", s),
                       "weight sync": stage("time/weight_sync", s)}
                      for s in sorted(h["time/step"])], "seconds": time.perf_counter() - t0}


def run_trl(python: Path, model: Path, steps: int, work: Path) -> dict:
    out = work / "trl.json"
    cmd = [str(python), str(REPO / "tools" / "bench" / "trl_grpo_runner.py"), "--model", str(model), "--steps",
           str(steps), "--out", str(out), "--work", str(work / "trl")]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"peer_trl: the TRL run failed:\n{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    result["wall"] = time.perf_counter() - t0
    return result


STAGES = ("generate", "update", "weight sync")


def summary(result: dict) -> dict:
    secs = [s["seconds"] for s in result["steps"]]
    rewards = [s["reward"] for s in result["steps"] if s.get("reward") is not None]
    later = result["steps"][1:] or result["steps"]
    stages = {k: statistics.fmean(s.get(k, 0.0) for s in later) for k in STAGES}
    stages["other"] = statistics.fmean(s["seconds"] for s in later) - sum(stages.values())
    return {"steps": len(secs), "s_per_step": statistics.fmean(secs),
            "s_per_step_after_first": statistics.fmean(secs[1:]) if len(secs) > 1 else float("nan"),
            "rewards": rewards, "stages": stages}


def report(r: dict) -> str:
    m, t = summary(r["mrl"]), summary(r["trl"])
    lines = [f"SmolLM2-135M GRPO ({JOB}: 8 prompts x 8 responses, 32 tokens), {m['steps']} steps each; load average "
             f"{r['load_before'][0]:.2f} before, {r['load_after'][0]:.2f} after",
             f"  {'':10} {'s/step':>8} {'after 1st':>10}  reward per step"]
    for name, s in (("mrl", m), ("TRL 1.16", t)):
        lines.append(f"  {name:10} {s['s_per_step']:>8.1f} {s['s_per_step_after_first']:>10.1f}  "
                     + " ".join(f"{x:.3f}" for x in s["rewards"]))
    lines.append(f"  TRL / mrl: {t['s_per_step'] / m['s_per_step']:.2f}x (all steps), "
                 f"{t['s_per_step_after_first'] / m['s_per_step_after_first']:.2f}x (after the first)")
    lines.append("  where a step goes (mean s after the first; TRL: generate = `_generate_and_score_completions`, "
                 "update = the rest of its step):")
    lines.append(f"  {'':10} " + " ".join(f"{k:>12}" for k in (*STAGES, "other")))
    for name, s in (("mrl", m), ("TRL 1.16", t)):
        lines.append(f"  {name:10} " + " ".join(f"{s['stages'][k]:>12.1f}" for k in (*STAGES, "other")))
    mu, tu = m["stages"]["update"], t["stages"]["update"]
    if mu > 0 and t["s_per_step_after_first"] > 0:
        lines.append(f"  TRL / mrl per stage: generate {t['stages']['generate'] / max(m['stages']['generate'], 1e-9):.2f}x, "
                     f"update {tu / mu:.2f}x; with mrl's rollout and sync free, TRL / mrl would be at most "
                     f"{t['s_per_step_after_first'] / (m['s_per_step_after_first'] - m['stages']['generate'] - m['stages']['weight sync']):.2f}x")
    if r["trl"].get("dropped_config"):
        lines.append(f"  (TRL's GRPOConfig has no {', '.join(r['trl']['dropped_config'])}: left at its defaults)")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--model", type=Path, default=default_model())
    ap.add_argument("--venv", type=Path, default=REPO / ".mrl-cache" / "trl-venv")
    ap.add_argument("--setup-only", action="store_true", help="build TRL's venv and stop")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    python = ensure_venv(args.venv)
    if args.setup_only:
        return
    if not (args.model / "config.json").is_file():
        sys.exit(f"peer_trl: no SmolLM2-135M-Instruct at {args.model}: build it with tools/models/smollm2.py")
    model = args.model.resolve()
    with tempfile.TemporaryDirectory(prefix="mrl-peer-trl-") as tmp:
        r = {"load_before": os.getloadavg()}
        r["mrl"] = run_mrl(model, args.steps, Path(tmp))
        r["trl"] = run_trl(python, model, args.steps, Path(tmp))
        r["load_after"] = os.getloadavg()
    print(report(r))
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
