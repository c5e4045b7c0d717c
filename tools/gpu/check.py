"""Check a machine end to end for mrl: install what is missing, run the GPU tier, benchmark, report.

    tools/gpu/check.sh [--wheels DIR] [--out DIR] [--quick] [--budget-s S]   # or: make gpu-check

1. **Install**: with `--wheels DIR` (a folder from tools/gpu/fetch_wheels.sh), every wheel whose
   distribution is not installed at that version (nor in the site folder from an earlier run) goes
   into a site folder with `pip install --no-index --no-deps --target`, and that folder joins
   PYTHONPATH ahead of the machine's own packages for everything below (so a carried
   `transformers==` pin replaces the machine's other version). The checkout itself
   is put on PYTHONPATH (with `mrl_kernels` linked to `kernels/`), so nothing needs `pip install -e`.
2. **Probe** (in a child process with that PYTHONPATH): versions of python, torch, triton,
   megatron-core, transformers, liger-kernel, vllm, ...; the device.
3. **Steps, most important figures first** (`ORDER`): the train step at the Qwen2.5-1.5B shape
   (MFU), the log-prob kernels (with liger when installed), the weight export; then the GPU tier
   `pytest -m '' tests/gpu` (bf16 train + resume + merge on cuda with the HF engine, each
   attention backend, delta sync verified on CUDA tensors, routing replay R3 on a tiny MoE) and
   the kernels' own tests `tests/kernels` (on CPU tests/gpu skips and tests/kernels runs the
   Triton interpreter), outcomes per test from tools/gpu/pytest_record.py; then the checksum
   bench, the train step at the 370M shape and RoPE. Each benchmark is a tools/bench script run
   with `--json`; on CPU (and with `--quick`) each runs its smoke size instead; targets are judged
   on full-size CUDA figures only.
5. **Report**: `<out>/report.json` and `<out>/report.md` (rewritten after every step, so a run
   stopped from outside still leaves one), logs per step in `<out>/logs/`.

Every step has a time cap and the whole check a budget (`--budget-s`, default 540 s: one
10-minute command with room to install). Whatever cannot run is listed under "skipped" with the
reason (CUDA absent, a missing package, `--quick`, the budget). Exit status: 0 when nothing
failed (skips allowed), 1 when the install, a test or a benchmark failed or a target was not
met, 2 on a usage error.
"""
from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_report as rep  # noqa: E402  (tools/gpu/check_report.py)

REPO = Path(__file__).resolve().parents[2]
RECORD_ENV = "MRL_GPU_CHECK_RECORD"

# The distributions the report lists, and the module each is imported as.
PACKAGES = {"torch": "torch", "triton": "triton", "megatron-core": "megatron.core", "transformers": "transformers",
            "liger-kernel": "liger_kernel", "vllm": "vllm", "transformer-engine": "transformer_engine",
            "tomli-w": "tomli_w", "psutil": "psutil", "hypothesis": "hypothesis",
            "sortedcontainers": "sortedcontainers",
            "pytest": "pytest", "pytest-xdist": "xdist", "mlflow": "mlflow", "tensorboard": "tensorboard"}

# tools/gpu/wheels.txt: what a bare GPU box lacks (the wheels fetch_wheels.sh downloads).
WHEEL_LIST = tuple(ln.split("==")[0] for ln in (Path(__file__).parent / "wheels.txt").read_text().splitlines()
                   if ln.strip() and not ln.startswith("#"))
# Not in the wheel list, and what their absence means for the check.
OPTIONAL = {"vllm": "the vLLM engine is not checked (too large for the wheel folder; tests/rollout -m vllm)",
            "transformer-engine": "model.attention = te is not checked (its wheels are ~280 MB and compile against "
                                  "torch)",
            "mlflow": "runs log to the console only (the GPU tier sets tracking.backends = [\"console\"])"}

# What each part needs beyond torch (the GPU tier writes checkpoints: megatron's torch_dist save
# hangs without psutil; `mrl train` writes the resolved spec with tomli-w).
TESTS = {"tests/gpu": ("megatron-core", "transformers", "tomli-w", "psutil"),
         "tests/kernels": ("hypothesis",)}
# Each test folder's time cap on a GPU (three short quickstart trainings, two MoE ones and a VLM
# one; Triton compiles). On CPU each gets CPU_TESTS_CAP_S. Measured on one H100 (2026-11-27): the
# quickstart test alone 182 s, R3 249 s and the VLM run 133 s beside it in 4 processes.
TESTS_CAP_S = {"tests/gpu": 300, "tests/kernels": 150}
# On a GPU with pytest-xdist, each folder's tests run in this many processes on the one device
# (the tests assert no time; the benchmarks never run beside them): the GPU tier's trainings and
# the kernels' Triton compiles are CPU-bound between short kernels.
XDIST_WORKERS = {"tests/gpu": 6, "tests/kernels": 8}
CPU_TESTS_CAP_S = 420
# The benchmark smoke tests in tests/gpu repeat what the benchmark steps measure in full.
BENCH_TESTS = ("tests/gpu/test_gpu.py::test_train_step_benchmark_reports_mfu_on_cuda",
               "tests/gpu/test_gpu.py::test_kernel_weight_and_rollout_benchmarks_run_on_cuda")


@dataclass(frozen=True)
class Bench:
    """One benchmark: `full` arguments (on CUDA), `smoke` arguments (a few seconds: on CPU, and
    with --quick; None skips it there, for `smoke_skip`), `cap_s` its time cap at full size.
    The driver adds `--device` and `--json`."""
    name: str
    script: str
    full: tuple[str, ...]
    smoke: tuple[str, ...] | None
    cap_s: float
    needs: tuple[str, ...] = ("megatron-core", "transformers")
    smoke_skip: str = ""


BENCHES = (  # in ORDER's order
    Bench("train_step_qwen2.5-1.5b", "train_step.py",
          ("--shape", "qwen2.5-1.5b", "--micro-batch-tokens", "8192", "--steps", "2"), None, 100,
          smoke_skip="no smoke size for a 1.5B-parameter model (train_step_370m ran the tiny one)"),
    Bench("kernels", "kernels.py", ("--iters", "10", "--warmup", "3"),
          ("--n", "48", "--v", "700", "--h", "16", "--iters", "1", "--warmup", "1"), 100, needs=()),
    Bench("weights", "weights.py", ("--dtype", "bf16", "--iters", "3", "--profile", "12"),
          ("--dtype", "bf16", "--hidden", "64", "--ffn", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2",
           "--vocab", "512", "--iters", "1", "--profile", "5"), 40),
    # The export at Qwen2.5-7B's layer shape (4 of its 28 layers, its vocabulary): whether the
    # small model's ratio is launch-bound per tensor or bytes moved more than once.
    Bench("weights_7b_layers", "weights.py", ("--dtype", "bf16", "--iters", "3", "--profile", "12", "--hidden", "3584",
                                              "--ffn", "18944", "--layers", "4", "--heads", "28", "--kv-heads", "4",
                                              "--vocab", "152064"), None, 60,
          smoke_skip="the weights step ran the smoke size"),
    # The log-prob kernels over BLOCK_V x num_warps (the forward's default was tuned on an H100).
    Bench("kernels_sweep", "kernels.py", ("--section", "logprob", "--sweep", "--iters", "5", "--warmup", "2"), None,
          90, needs=(), smoke_skip="the sweep times Triton on CUDA only"),
    Bench("checksum", "checksum.py", ("--repeat", "3"), ("--repeat", "1"), 40),
    Bench("train_step_370m", "train_step.py", ("--shape", "370m", "--steps", "2"),
          ("--shape", "tiny", "--steps", "1", "--responses", "8", "--prompt-len", "16", "--response-len", "32",
           "--micro-batch-tokens", "200"), 60),
    Bench("rope", "rope.py", ("--dtype", "bf16"),
          ("--tokens", "256", "--sequences", "16", "--heads", "2", "--head-dim", "16", "--iters", "2", "--warmup", "1"),
          25),
)
# The order of the steps: the figures the targets judge first, so a run stopped early still has them.
ORDER = ("train_step_qwen2.5-1.5b", "kernels", "weights", "weights_7b_layers", "tests/gpu", "kernels_sweep",
         "tests/kernels", "checksum", "train_step_370m", "rope")
assert sorted(ORDER) == sorted([b.name for b in BENCHES] + list(TESTS))
SMOKE_CAP_S = 120


@dataclass
class Budget:
    total_s: float
    t0: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.total_s - (time.monotonic() - self.t0)


def utc() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def run_capped(cmd: list[str], env: dict, timeout_s: float, log: Path) -> tuple[int | None, float, str]:
    """Run `cmd` in its own process group with stdout+stderr to `log`; on timeout the whole group is
    killed. Returns (exit status or None when timed out, seconds, the output's last 3000 chars)."""
    t = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(timeout_s, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    return rc, time.monotonic() - t, log.read_text(errors="replace")[-3000:]


# ------------------------------------------------------------------------------------------
# Install and probe.
# ------------------------------------------------------------------------------------------

def wheel_distribution(path: Path) -> str:
    """`megatron_core-0.16.1-py3-none-any.whl` -> `megatron-core` (PEP 503 normalised)."""
    return re.sub(r"[-_.]+", "-", path.name.split("-")[0]).lower()


def wheel_version(path: Path) -> str:
    """`megatron_core-0.16.1-py3-none-any.whl` -> `0.16.1`."""
    return path.name.split("-")[1]


def installed_version(dist: str, search: list[str]) -> str | None:
    for d in importlib.metadata.distributions(path=search):
        if re.sub(r"[-_.]+", "-", d.metadata["Name"] or "").lower() == dist:
            return d.version
    return None


def install_wheels(wheels: Path, site: Path, python: str) -> dict:
    """Install into `site` every wheel in `wheels` whose distribution is not on this interpreter's
    path at the wheel's version (`site` from an earlier run first); a different version already
    there is listed under `replaced` (the site folder comes first on the children's path)."""
    entry = dict(wheels_dir=str(wheels), site=str(site), installed=[], present=[], replaced=[], error="")
    found = sorted(wheels.glob("*.whl"))
    if not found:
        entry["error"] = f"no .whl files in {wheels}"
        return entry
    missing = []
    for whl in found:
        dist, want = wheel_distribution(whl), wheel_version(whl)
        have = installed_version(dist, [str(site)]) or installed_version(dist, sys.path)
        if have == want:
            entry["present"].append(f"{dist} {have}")
        else:
            missing.append(whl)
            if have:
                entry["replaced"].append(f"{dist} {have} -> {want}")
    if missing:
        site.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
                               *map(str, missing)], capture_output=True, text=True)
        if proc.returncode:
            entry["error"] = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        else:
            entry["installed"] = [w.name for w in missing]
    return entry


def child_env(site: Path | None, shim: Path, record: Path) -> dict:
    """This checkout first (mrl, tests; `mrl_kernels` through `shim`), then the wheel site, then
    whatever PYTHONPATH the caller had."""
    caller = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    parts = [str(REPO), str(shim)] + ([str(site)] if site else []) + caller
    return {**os.environ, "PYTHONPATH": os.pathsep.join(parts), RECORD_ENV: str(record), "PYTHONUNBUFFERED": "1"}


PROBE = r"""
import importlib.metadata as md, importlib.util as iu, json, platform, sys
packages = json.loads(sys.argv[1])
out = {"versions": {"python": platform.python_version()}, "importable": {}}
for dist, module in packages.items():
    try:
        out["importable"][dist] = iu.find_spec(module) is not None
    except Exception:
        out["importable"][dist] = False
    try:  # a distribution that cannot be imported counts as missing
        out["versions"][dist] = md.version(dist) if out["importable"][dist] else None
    except md.PackageNotFoundError:
        out["versions"][dist] = None
import torch
dev = {"cuda": torch.cuda.is_available(), "name": "cpu", "count": 0, "capability": None, "memory_gib": None,
       "torch_cuda": torch.version.cuda}
if dev["cuda"]:
    p = torch.cuda.get_device_properties(0)
    dev.update(name=p.name, count=torch.cuda.device_count(), capability=f"{p.major}.{p.minor}",
               memory_gib=p.total_memory / 2**30)
out["device"] = dev
print(json.dumps(out))
"""


def probe(python: str, env: dict) -> dict:
    proc = subprocess.run([python, "-c", PROBE, json.dumps(PACKAGES)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    if proc.returncode:
        raise SystemExit(f"gpu-check: cannot import torch with {python}: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------
# The check.
# ------------------------------------------------------------------------------------------

class Check:
    def __init__(self, args):
        self.args, self.out = args, Path(args.out).resolve()
        self.budget = Budget(args.budget_s)
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        (self.out / "bench").mkdir(exist_ok=True)
        self.record = self.out / "tests.jsonl"
        self.record.unlink(missing_ok=True)
        # A temporary folder on the children's PYTHONPATH: `mrl_kernels` -> kernels/, and the plugin.
        self.shim = Path(args.shim)
        (self.shim / "mrl_kernels").symlink_to(REPO / "kernels")
        (self.shim / "pytest_record.py").symlink_to(Path(__file__).resolve().parent / "pytest_record.py")
        self.site = Path(args.site).resolve() if args.wheels else None
        self.report = dict(schema=rep.SCHEMA, mode="quick" if args.quick else "full", started_utc=utc(),
                           finished_utc="", wall_s=0.0, budget_s=args.budget_s, host=socket.gethostname(),
                           commit=self._commit(), out_dir=str(self.out), device={}, versions={},
                           install=dict(wheels_dir=None, site=None, installed=[], present=[], error=""),
                           tests=dict(ran=False, command=[], wall_s=0.0, timed_out=False, counts={}, results=[]),
                           benchmarks=[], targets=[], skipped=[])

    @staticmethod
    def _commit() -> str:
        proc = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        return proc.stdout.strip() or "unknown"

    def skip(self, what: str, why: str) -> None:
        self.report["skipped"].append(dict(what=what, why=why))

    def missing(self, needs) -> list[str]:
        return [n for n in needs if not self.importable.get(n)]

    def write(self) -> None:
        r = self.report
        r["finished_utc"], r["wall_s"] = utc(), self.budget.total_s - self.budget.left()
        benches = {b["name"]: b for b in r["benchmarks"]}
        tests = {t["nodeid"]: t for t in r["tests"]["results"]}
        r["targets"] = [rep.evaluate(t, benches, tests) for t in rep.TARGETS]
        (self.out / "report.json").write_text(json.dumps(r, indent=1))
        (self.out / "report.md").write_text(rep.markdown(r))

    def run(self) -> int:
        a, py = self.args, self.args.python
        if a.wheels:
            self.report["install"] = install_wheels(Path(a.wheels).resolve(), self.site, py)
        self.env = child_env(self.site, self.shim, self.record)
        found = probe(py, self.env)
        self.report.update(versions=found["versions"], device=found["device"])
        self.importable, self.cuda = found["importable"], found["device"]["cuda"]
        if not self.cuda:
            self.skip("CUDA", "no CUDA device here: tests/gpu skips, tests/kernels runs the Triton interpreter, "
                              "every benchmark runs its CPU smoke size, and no target is judged")
        for dist in WHEEL_LIST:
            if not self.importable.get(dist):
                hint = "" if a.wheels else " (pass --wheels DIR; tools/gpu/fetch_wheels.sh)"
                self.skip(dist, "not installed" + hint)
        for dist, why in OPTIONAL.items():
            if not self.importable.get(dist):
                self.skip(dist, f"not installed: {why}")
        self.write()
        if a.no_tests:
            self.skip("tests", "--no-tests")
        benches = {b.name: b for b in BENCHES}
        for step in ORDER:
            if step in benches:
                self.run_bench(benches[step])
            elif not a.no_tests:
                self.run_tests(step)
        self.write()
        r = self.report
        bad = (bool(r["install"]["error"])
               or any(t["outcome"] in ("failed", "unfinished") for t in r["tests"]["results"])
               or any(b["status"] not in ("ok", "skipped") for b in r["benchmarks"])
               or any(t["status"] in ("failed", "not met") for t in r["targets"]))
        print(rep.markdown(r))
        return 1 if bad else 0

    def run_tests(self, path: str) -> None:
        """One test folder under its own cap; its outcomes join the report's `tests`."""
        if self.args.quick and path == "tests/kernels":
            self.skip(path, "--quick (the kernels' own tests: a minute or two under the CPU interpreter, "
                            "longer with Triton compiles on a GPU)")
            return
        if self.missing(TESTS[path]):
            self.skip(path, f"needs {', '.join(self.missing(TESTS[path]))}")
            return
        cap = min(TESTS_CAP_S[path] if self.cuda else CPU_TESTS_CAP_S, self.budget.left() - 30)
        if cap < 10:
            self.skip(path, "time budget spent")
            return
        deselect = [t for t in BENCH_TESTS if t.startswith(path + "/")] if not self.args.no_bench else []
        if deselect:
            self.skip(f"benchmark smoke tests of {path}", "the benchmark steps run those benchmarks in full")
        cmd = [self.args.python, "-m", "pytest", "-q", "-m", "", "-p", "pytest_record", "-p", "no:cacheprovider",
               path, *(f"--deselect={t}" for t in deselect)]
        if self.cuda and self.importable.get("pytest-xdist"):
            cmd += ["-n", str(XDIST_WORKERS[path])]
        self.record.unlink(missing_ok=True)
        name = path.replace("/", "_")
        rc, wall, _ = run_capped(cmd, self.env, cap, self.out / "logs" / f"{name}.log")
        results = rep.test_outcomes(rep.read_jsonl(self.record))
        if rc not in (0, 5, None) and not any(r["outcome"] == "failed" for r in results):
            results.append(dict(nodeid=path, outcome="failed", duration_s=wall,
                                message=f"pytest exited {rc} (see logs/{name}.log)"))
        t = self.report["tests"]
        all_results = t["results"] + results
        self.report["tests"] = dict(ran=True, command=t["command"] + [["pytest", "-m", "''", path]],
                                    wall_s=t["wall_s"] + wall, timed_out=t["timed_out"] or rc is None,
                                    exit_status=rc if t.get("exit_status") in (None, 0, 5) else t["exit_status"],
                                    counts=rep.counts(all_results), results=all_results)
        self.write()

    def run_bench(self, b: Bench) -> None:
        smoke = self.args.quick or not self.cuda
        entry = dict(name=b.name, command=[], size="smoke" if smoke else "full", status="skipped", reason="",
                     wall_s=0.0, figures=None, output_tail="")
        self.report["benchmarks"].append(entry)
        argv = b.smoke if smoke else b.full
        cap = SMOKE_CAP_S if smoke else b.cap_s
        if self.args.no_bench:
            entry["reason"] = "--no-bench"
        elif argv is None:
            entry["reason"] = ("--quick: " if self.cuda else "CUDA absent: ") + b.smoke_skip
        elif self.missing(b.needs):
            entry["reason"] = f"needs {', '.join(self.missing(b.needs))}"
        elif min(cap, self.budget.left()) < 10:
            entry["reason"] = "time budget spent"
        if entry["reason"]:
            self.skip(f"benchmark {b.name}", entry["reason"])
            self.write()
            return
        figures = self.out / "bench" / f"{b.name}.json"
        figures.unlink(missing_ok=True)
        argv = (*argv, "--device", "cuda" if self.cuda else "cpu")
        cmd = [self.args.python, str(REPO / "tools/bench" / b.script), *argv, "--json", str(figures)]
        entry["command"] = ["python", f"tools/bench/{b.script}", *argv]
        rc, entry["wall_s"], tail = run_capped(cmd, self.env, min(cap, self.budget.left()),
                                               self.out / "logs" / f"{b.name}.log")
        entry["output_tail"] = tail[-1500:]
        if rc is None:
            entry.update(status="timed out", reason=f"stopped after {entry['wall_s']:.0f} s (its cap)")
        elif rc != 0 or not figures.exists():
            last = [ln for ln in tail.splitlines() if ln.strip()][-1:] or [f"exit {rc}"]
            entry.update(status="failed", reason=last[0][:300])
        else:
            entry.update(status="ok", figures=json.loads(figures.read_text()))
        self.write()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="CONTRIBUTING.md, 'The GPU tier'")
    ap.add_argument("--wheels", default=os.environ.get("WHEELS") or None,
                    help="folder of wheels to install what is missing from (default: $WHEELS)")
    ap.add_argument("--site", default=os.path.join(tempfile.gettempdir(), "mrl-gpu-check-site"),
                    help="where --wheels installs (kept between runs; default %(default)s)")
    ap.add_argument("--out", default=str(REPO / "gpu-check"), help="report folder (default %(default)s)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="time for the whole check")
    ap.add_argument("--quick", action="store_true",
                    help="skip tests/kernels and run every benchmark at its smoke size (no target is judged)")
    ap.add_argument("--no-tests", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the tests and benchmarks")
    args = ap.parse_args(argv)
    if args.wheels and not Path(args.wheels).is_dir():
        ap.error(f"--wheels {args.wheels}: not a folder")
    with tempfile.TemporaryDirectory(prefix="mrl-gpu-check-") as shim:
        args.shim = shim
        return Check(args).run()


if __name__ == "__main__":
    sys.exit(main())
