"""The GPU check's report: per-test outcomes, the figures against their targets, markdown.

Pure functions over plain data (the check's JSON report), so each rule is testable without a
GPU: `test_outcomes` folds the pytest plugin's per-phase lines into one outcome per test,
`evaluate` judges every target from a benchmark's figures, `markdown` renders the report.

A target is only judged on figures measured on CUDA: a CPU smoke run proves the benchmark
runs, not how fast mrl is, so its targets are `skipped` with the reason.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SCHEMA = 1
STATUSES = ("met", "not met", "failed", "skipped")


# ------------------------------------------------------------------------------------------
# Tests.
# ------------------------------------------------------------------------------------------

def read_jsonl(path: Path) -> list[dict]:
    """The plugin's lines; a torn last line (the run was killed mid-write) is dropped."""
    if not path.exists():
        return []
    lines = []
    for raw in path.read_text().splitlines():
        try:
            lines.append(json.loads(raw))
        except json.JSONDecodeError:
            continue
    return lines


def test_outcomes(lines: list[dict]) -> list[dict]:
    """One entry per test in first-seen order: `failed` if any phase failed (collection included),
    else `skipped` if a phase skipped, else `passed` once its call passed. A test whose call never
    reported (the run was stopped) is `unfinished`."""
    order: list[str] = []
    phases: dict[str, list[dict]] = {}
    for line in lines:
        if line["nodeid"] not in phases:
            order.append(line["nodeid"])
            phases[line["nodeid"]] = []
        phases[line["nodeid"]].append(line)
    out = []
    for nodeid in order:
        ps = phases[nodeid]
        failed = [p for p in ps if p["outcome"] == "failed"]
        skipped = [p for p in ps if p["outcome"] == "skipped"]
        if failed:
            outcome, message = "failed", failed[0]["message"]
            if failed[0]["when"] != "call":
                message = f"[{failed[0]['when']}] {message}"
        elif skipped:
            outcome, message = "skipped", skipped[0]["message"]
        elif any(p["when"] == "call" and p["outcome"] == "passed" for p in ps):
            outcome, message = "passed", ""
        else:
            outcome, message = "unfinished", "stopped before the test finished (time budget)"
        out.append(dict(nodeid=nodeid, outcome=outcome, duration_s=round(sum(p["duration_s"] for p in ps), 3),
                        message=message))
    return out


def counts(results: list[dict]) -> dict[str, int]:
    c: dict[str, int] = {}
    for r in results:
        c[r["outcome"]] = c.get(r["outcome"], 0) + 1
    return c


# ------------------------------------------------------------------------------------------
# Targets.
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """`figure` (a path of keys into benchmark `bench`'s figures) compared with `threshold` by
    `op`; `scale`/`unit` only shape the printed value. `test` instead names a test whose pass is
    the target."""
    name: str
    description: str
    bench: str | None = None
    figure: tuple[str, ...] = ()
    op: str = ">="
    threshold: float = 0.0
    scale: float = 1.0
    unit: str = ""
    test: str | None = None

    def wanted(self) -> str:
        if self.test:
            return "passes"
        return f"{self.op} {self.threshold * self.scale:g}{self.unit}"


QUICKSTART_TEST = "tests/gpu/test_gpu.py::test_quickstart_trains_20_bf16_steps_on_cuda_resumes_and_merges"

TARGETS = (
    Target("train_step_mfu", "train step MFU at the Qwen2.5-1.5B shape (bf16; 6 x params x tokens)",
           "train_step_qwen2.5-1.5b", ("mfu",), ">=", 0.40, 100, "%"),
    Target("train_step_outside_model_math", "share of the step outside model math at Qwen2.5-1.5B",
           "train_step_qwen2.5-1.5b", ("share_outside_model_math",), "<=", 0.02, 100, "%"),
    Target("logprob_forward_hbm", "log-prob kernel forward, share of peak HBM bandwidth",
           "kernels", ("logprob", "fwd_pct_hbm"), ">=", 85, 1, "%"),
    Target("fused_linear_speed_vs_liger", "fused linear -> log-prob fwd+bwd speed, liger time / mrl time",
           "kernels", ("linear", "liger_over_fused_fwd_bwd"), ">=", 1.0, 1, "x"),
    Target("fused_linear_memory_vs_liger", "fused linear -> log-prob fwd+bwd peak memory, mrl / liger",
           "kernels", ("linear", "peak_fused_over_liger"), "<=", 1.5, 1, "x"),
    # Judged at Qwen2.5-7B's layer shape: at 246M params (the `weights` step) the export is host-bound,
    # ~20 us of dispatch per tensor (one H100: 195 tensors, 0.41 ms of device time in 4.0 ms).
    Target("weight_export_vs_copy", "weight export throughput / plain device copy (bf16, Qwen2.5-7B layer shape)",
           "weights_7b_layers", ("export_over_copy",), ">=", 0.8, 1, "x"),
    Target("quickstart_cuda_bf16_resume", "the quickstart trains on cuda (HF engine, bf16), resumes, merges",
           test=QUICKSTART_TEST),
)


def _dig(figures: dict | None, path: tuple[str, ...]):
    for key in path:
        if not isinstance(figures, dict):
            return None
        figures = figures.get(key)
    return figures


def _why_missing(target: Target, figures: dict) -> str:
    """Why a CUDA run of the benchmark has no value for this figure."""
    if target.bench == "kernels" and "liger" in target.name and not figures.get("liger"):
        return figures.get("liger_note") or "liger-kernel not installed"
    if target.name == "train_step_mfu":
        return f"peak bf16 FLOP/s of {figures.get('device_name')!r} unknown to tools/bench/train_step.py"
    if target.name == "logprob_forward_hbm":
        return f"peak HBM bandwidth of {figures.get('device_name')!r} unknown to tools/bench/kernels.py"
    return "the benchmark did not report this figure"


def evaluate(target: Target, benches: dict[str, dict], tests: dict[str, dict]) -> dict:
    """`target` judged from the benchmark steps (name -> step entry) and test outcomes (nodeid ->
    entry): status `met` / `not met` / `failed` (its benchmark or test failed) / `skipped` (why)."""
    row = dict(name=target.name, description=target.description, wanted=target.wanted(), value=None,
               shown="-", status="skipped", reason="", source=target.test or target.bench)
    if target.test:
        result = tests.get(target.test)
        if result is None:
            row["reason"] = "the test did not run"
        elif result["outcome"] == "passed":
            row.update(status="met", shown="passed")
        elif result["outcome"] in ("failed", "unfinished"):
            row.update(status="failed", shown=result["outcome"], reason=result["message"].splitlines()[-1:][0]
                       if result["message"] else result["outcome"])
        else:
            row["reason"] = result["message"] or "skipped"
        return row
    step = benches.get(target.bench)
    if step is None:
        row["reason"] = f"benchmark {target.bench} did not run"
        return row
    if step["status"] == "skipped":
        row["reason"] = step["reason"]
        return row
    if step["status"] != "ok":
        row.update(status="failed", reason=f"benchmark {target.bench} {step['status']}: {step['reason']}")
        return row
    figures = step["figures"] or {}
    if figures.get("device") != "cuda":
        row["reason"] = f"measured on {figures.get('device', '?')} (a smoke run); the targets are for CUDA"
        return row
    if step["size"] != "full":
        row["reason"] = "measured at the smoke size (--quick)"
        return row
    value = _dig(figures, target.figure)
    if value is None:
        row["reason"] = _why_missing(target, figures)
        return row
    met = value >= target.threshold if target.op == ">=" else value <= target.threshold
    row.update(value=value, shown=f"{value * target.scale:.3g}{target.unit}", status="met" if met else "not met")
    return row


def _num(x, spec: str, suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def headline(name: str, figures: dict | None) -> str:
    """The few figures of a benchmark worth a glance (all of them are in its JSON)."""
    f = figures or {}
    if not f:
        return ""
    if name.startswith("train_step"):
        return (f"{_num(f.get('params', 0) / 1e6, '.0f')}M params, {f.get('tokens_per_step')} tokens/step: "
                f"{_num(f.get('step_ms'), '.0f', ' ms')}, {_num(f.get('tokens_per_s'), ',.0f')} tokens/s, "
                f"MFU {_num(f['mfu'] * 100 if f.get('mfu') is not None else None, '.1f', '%')}, "
                f"outside model math {_num(f.get('share_outside_model_math', 0) * 100, '.1f', '%')}, "
                f"peak {_num(f.get('peak_memory_gib'), '.1f', ' GiB')}")
    if name == "kernels":
        lp, ln = f.get("logprob") or {}, f.get("linear") or {}
        return (f"log-prob fwd {_num(lp.get('fwd_pct_hbm'), '.1f', '% HBM')}, "
                f"{_num(lp.get('eager_over_mrl_fwd'), '.1f', 'x')} eager; fwd+bwd liger/mrl "
                f"{_num(lp.get('liger_over_mrl_fwd_bwd'), '.2f', 'x')}; fused linear liger/mrl time "
                f"{_num(ln.get('liger_over_fused_fwd_bwd'), '.2f', 'x')}, mrl/liger memory "
                f"{_num(ln.get('peak_fused_over_liger'), '.2f', 'x')} ({f.get('backend')})")
    if name.startswith("weights"):
        prof = f.get("profile") or {}
        return (f"{_num(f.get('params', 0) / 1e6, '.0f')}M params: export {_num(f.get('export_gbps'), '.1f', ' GB/s')}, "
                f"copy {_num(f.get('copy_gbps'), '.1f', ' GB/s')}, ratio {_num(f.get('export_over_copy'), '.2f')}"
                + (f"; profile: {prof.get('tensors')} tensors, {prof.get('device_kernels')} kernels, "
                   f"{_num(prof.get('device_ms'), '.2f', ' ms')} device" if prof else ""))
    if name == "kernels_sweep":
        rows = [r for r in f.get("sweep") or [] if "fwd_pct_hbm" in r]
        if not rows:
            return "no sweep rows"
        fwd = max(rows, key=lambda r: r["fwd_pct_hbm"])
        bwd = max(rows, key=lambda r: r["bwd_pct_hbm"])
        return (f"best fwd {fwd['block_v']}x{fwd['num_warps']}w {fwd['fwd_pct_hbm']:.1f}% HBM; best bwd "
                f"{bwd['block_v']}x{bwd['num_warps']}w {bwd['bwd_pct_hbm']:.1f}% HBM; default fwd "
                f"{_num((f.get('logprob') or {}).get('fwd_pct_hbm'), '.1f', '%')}")
    if name == "checksum":
        return ", ".join(f"{k} {_num(c.get('gbps'), '.1f', ' GB/s')}" for k, c in (f.get("cases") or {}).items())
    if name == "rope":
        return (f"megatron/mrl {_num(f.get('megatron_over_mrl_with_tables'), '.1f', 'x')} with tables, "
                f"{_num(f.get('megatron_over_mrl_rotate'), '.1f', 'x')} rotate only")
    return ""


# ------------------------------------------------------------------------------------------
# Markdown.
# ------------------------------------------------------------------------------------------

def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(report: dict) -> str:
    dev = report["device"]
    lines = [f"# mrl GPU check ({report['mode']})", "",
             f"{report['started_utc']} to {report['finished_utc']} ({report['wall_s']:.0f} s of a "
             f"{report['budget_s']:.0f} s budget) on `{report['host']}`, commit `{report['commit']}`.", "",
             f"**Device:** {dev['name']}" + (f" (capability {dev['capability']}, {dev['memory_gib']:.0f} GiB, CUDA "
                                             f"{dev['torch_cuda']})" if dev["cuda"] else ""), "",
             "## Versions", "", "| package | version |", "| --- | --- |"]
    lines += [f"| {k} | {v or 'missing'} |" for k, v in report["versions"].items()]
    inst = report["install"]
    if inst["wheels_dir"]:
        lines += ["", f"Wheels from `{inst['wheels_dir']}` into `{inst['site']}`: installed "
                      f"{', '.join(inst['installed']) or 'none'}; already present "
                      f"{', '.join(inst['present']) or 'none'}"
                      + (f"; in place of the machine's own {', '.join(inst['replaced'])}" if inst.get("replaced") else "")
                      + (f"; error: {inst['error']}" if inst["error"] else "")]
    lines += ["", "## Targets", "", "| target | wanted | measured | status | note |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {_cell(t['description'])} | {_cell(t['wanted'])} | {_cell(t['shown'])} | **{t['status']}** | "
              f"{_cell(t['reason'])} |" for t in report["targets"]]
    tests = report["tests"]
    lines += ["", "## Tests", ""]
    if tests["results"] or tests["ran"]:
        c = ", ".join(f"{v} {k}" for k, v in sorted(tests["counts"].items())) or "none collected"
        lines += [f"{', '.join('`' + ' '.join(cmd) + '`' for cmd in tests['command'])}: {c} in {tests['wall_s']:.0f} s"
                  + (" (stopped at its time budget)" if tests["timed_out"] else "") + ".", "",
                  "| test | outcome | s | message |", "| --- | --- | --- | --- |"]
        lines += [f"| `{r['nodeid']}` | {r['outcome']} | {r['duration_s']:.1f} | {_cell(r['message'][:200])} |"
                  for r in tests["results"]]
    lines += ["", "## Benchmarks", "", "| benchmark | status | size | s | figures (or why not) |",
              "| --- | --- | --- | --- | --- |"]
    lines += [f"| `{b['name']}` | {b['status']} | {b['size']} | {b['wall_s']:.0f} | "
              f"{_cell(headline(b['name'], b['figures']) or b['reason'])} |" for b in report["benchmarks"]]
    lines += ["", "## Skipped", ""]
    lines += [f"- **{s['what']}**: {s['why']}" for s in report["skipped"]] or ["nothing"]
    lines += ["", f"Logs and the figures of each benchmark: `{report['out_dir']}`.", ""]
    return "\n".join(lines)
