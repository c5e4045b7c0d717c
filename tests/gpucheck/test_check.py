"""`make gpu-check` (tools/gpu/check.py) on a CPU machine: the report's structure, named skips,
the wheel folder install, and the rules that fold test phases and judge targets.

The two end-to-end runs use `--quick` (tests/gpu, which skips without CUDA, and every benchmark
at its smoke size): about 30 s together. On a CUDA machine the check itself is the test.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from tests.dist_util import REPO

GPU = REPO / "tools" / "gpu"


def _load(name: str, as_name: str):
    """tools/gpu/<name>.py as module `as_name` (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(as_name, GPU / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[as_name] = module
    spec.loader.exec_module(module)
    return module


report = _load("check_report", "check_report")  # the name check.py imports it by
check = _load("check", "mrl_gpu_check")


# ------------------------------------------------------------------------------------------
# The rules.
# ------------------------------------------------------------------------------------------

def _line(nodeid, when, outcome, message="", duration_s=1.0):
    return dict(nodeid=nodeid, when=when, outcome=outcome, message=message, duration_s=duration_s)


def test_phases_fold_into_one_outcome_per_test():
    lines = [_line("a", "setup", "passed"), _line("a", "call", "passed"), _line("a", "teardown", "passed"),
             _line("b", "setup", "skipped", "the GPU tier needs CUDA", 0.0), _line("b", "teardown", "passed", "", 0.0),
             _line("c", "setup", "passed"), _line("c", "call", "failed", "assert 1 == 2"),
             _line("c", "teardown", "passed"),
             _line("d", "setup", "passed"), _line("d", "call", "passed"), _line("d", "teardown", "failed", "leak"),
             _line("e.py", "collect", "failed", "ModuleNotFoundError: megatron", 0.0),
             _line("f", "setup", "passed")]  # the run was stopped during f
    got = {r["nodeid"]: (r["outcome"], r["message"], r["duration_s"]) for r in report.test_outcomes(lines)}
    assert got == {"a": ("passed", "", 3.0), "b": ("skipped", "the GPU tier needs CUDA", 0.0),
                   "c": ("failed", "assert 1 == 2", 3.0), "d": ("failed", "[teardown] leak", 3.0),
                   "e.py": ("failed", "[collect] ModuleNotFoundError: megatron", 0.0),
                   "f": ("unfinished", "stopped before the test finished (time budget)", 1.0)}
    assert report.counts(report.test_outcomes(lines)) == {"passed": 1, "skipped": 1, "failed": 3, "unfinished": 1}


def test_a_torn_last_line_is_dropped(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(_line("a", "call", "passed")) + "\n" + '{"nodeid": "b", "wh')
    assert [x["nodeid"] for x in report.read_jsonl(path)] == ["a"]


def _bench(name, figures, status="ok", size="full", reason=""):
    return {name: dict(name=name, status=status, size=size, reason=reason, figures=figures)}


MFU, MEM, HBM, LIGER = (next(t for t in report.TARGETS if t.name == n) for n in (
    "train_step_mfu", "fused_linear_memory_vs_liger", "logprob_forward_hbm", "fused_linear_speed_vs_liger"))


def test_targets_are_judged_on_full_size_cuda_figures_only():
    cuda = dict(device="cuda", device_name="NVIDIA H100 80GB HBM3", mfu=0.291)
    row = report.evaluate(MFU, _bench("train_step_qwen2.5-1.5b", cuda), {})
    assert (row["status"], row["shown"], row["wanted"]) == ("not met", "29.1%", ">= 40%")
    assert report.evaluate(MFU, _bench("train_step_qwen2.5-1.5b", {**cuda, "mfu": 0.4}), {})["status"] == "met"
    cpu = report.evaluate(MFU, _bench("train_step_qwen2.5-1.5b", {**cuda, "device": "cpu"}), {})
    assert cpu["status"] == "skipped" and "cpu" in cpu["reason"]
    smoke = report.evaluate(MFU, _bench("train_step_qwen2.5-1.5b", cuda, size="smoke"), {})
    assert smoke["status"] == "skipped" and "smoke" in smoke["reason"]
    unknown = report.evaluate(MFU, _bench("train_step_qwen2.5-1.5b", {**cuda, "mfu": None}), {})
    assert unknown["status"] == "skipped" and "H100" in unknown["reason"]
    failed = report.evaluate(MFU, _bench("train_step_qwen2.5-1.5b", None, status="failed", reason="CUDA OOM"), {})
    assert failed["status"] == "failed" and "CUDA OOM" in failed["reason"]
    gone = report.evaluate(MFU, {}, {})
    assert gone["status"] == "skipped" and "did not run" in gone["reason"]


def test_lower_is_better_targets_and_a_missing_peer_are_named():
    linear = dict(device="cuda", liger=True, linear=dict(peak_fused_over_liger=1.5, liger_over_fused_fwd_bwd=0.71),
                  logprob=dict(fwd_pct_hbm=87.0))
    benches = _bench("kernels", linear)
    assert report.evaluate(MEM, benches, {})["status"] == "met"  # <= 1.5 includes 1.5
    assert report.evaluate(LIGER, benches, {})["status"] == "not met"
    assert report.evaluate(HBM, benches, {})["shown"] == "87%"
    no_liger = dict(device="cuda", liger=False, liger_note="skipped (liger-kernel not installed)",
                    linear=dict(peak_fused_over_liger=None, liger_over_fused_fwd_bwd=None))
    row = report.evaluate(LIGER, _bench("kernels", no_liger), {})
    assert row["status"] == "skipped" and "liger-kernel not installed" in row["reason"]


def test_the_quickstart_target_is_its_test():
    target = next(t for t in report.TARGETS if t.test)
    assert report.evaluate(target, {}, {target.test: dict(outcome="passed", message="")})["status"] == "met"
    row = report.evaluate(target, {}, {target.test: dict(outcome="failed", message="x\nAssertionError: resume")})
    assert (row["status"], row["reason"]) == ("failed", "AssertionError: resume")
    assert report.evaluate(target, {}, {})["reason"] == "the test did not run"


def test_wheel_names_map_to_distributions():
    megatron = Path("megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl")
    assert check.wheel_distribution(megatron) == "megatron-core"
    assert check.wheel_distribution(Path("tomli_w-1.2.0-py3-none-any.whl")) == "tomli-w"
    assert "megatron-core" in check.WHEEL_LIST and "liger-kernel" in check.WHEEL_LIST
    assert set(check.WHEEL_LIST) <= set(check.PACKAGES)  # each is probed (and reported) by its module


def test_an_empty_wheel_folder_is_an_install_error(tmp_path):
    entry = check.install_wheels(tmp_path, tmp_path / "site", sys.executable)
    assert entry["error"] == f"no .whl files in {tmp_path}" and not entry["installed"]


def test_a_wheel_goes_in_unless_its_version_is_already_there(tmp_path):
    """A wheel at the installed version is left alone; another version is installed into the site
    folder (which comes first on the children's path) and listed as replacing the machine's."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "torch", torch.__version__, "torch")      # the same version: left alone
    _wheel(wheels, "pytest", "0.0.1", "pytest_probe_other")   # another version of an installed one
    entry = check.install_wheels(wheels, tmp_path / "site", sys.executable)
    assert entry["present"] == [f"torch {torch.__version__}"] and not entry["error"], entry
    assert entry["installed"] == ["pytest-0.0.1-py3-none-any.whl"]
    assert entry["replaced"] == [f"pytest {pytest.__version__} -> 0.0.1"]
    again = check.install_wheels(wheels, tmp_path / "site", sys.executable)   # the site folder is read first
    assert not again["installed"] and "pytest 0.0.1" in again["present"], again


def test_the_steps_put_the_judged_figures_first():
    assert check.ORDER[:3] == ("train_step_qwen2.5-1.5b", "kernels", "weights")
    assert check.ORDER.index("tests/gpu") < check.ORDER.index("tests/kernels")
    assert [b.name for b in check.BENCHES] == [n for n in check.ORDER if n not in check.TESTS]


def test_headlines_pick_the_figures_worth_a_glance():
    train = dict(params=1.5e9, tokens_per_step=58000, step_ms=1800.0, tokens_per_s=32222.0, mfu=0.291,
                 share_outside_model_math=0.031, peak_memory_gib=61.2)
    assert report.headline("train_step_qwen2.5-1.5b", train) == (
        "1500M params, 58000 tokens/step: 1800 ms, 32,222 tokens/s, MFU 29.1%, outside model math 3.1%, peak 61.2 GiB")
    assert report.headline("weights", dict(params=246e6, export_gbps=1.05, copy_gbps=3.0, export_over_copy=0.35)) == (
        "246M params: export 1.1 GB/s, copy 3.0 GB/s, ratio 0.35")
    prof = dict(tensors=27, device_kernels=54, device_ms=1.234)
    assert report.headline("weights_7b_layers", dict(params=2e9, export_gbps=500.0, copy_gbps=600.0,
                                                     export_over_copy=0.83, profile=prof)) == (
        "2000M params: export 500.0 GB/s, copy 600.0 GB/s, ratio 0.83; profile: 27 tensors, 54 kernels, 1.23 ms device")
    sweep = [dict(block_v=4096, num_warps=4, fwd_pct_hbm=87.0, bwd_pct_hbm=70.0),
             dict(block_v=8192, num_warps=8, fwd_pct_hbm=80.0, bwd_pct_hbm=75.5), dict(block_v=16384, num_warps=4,
                                                                                     error="out of resources")]
    assert report.headline("kernels_sweep", dict(sweep=sweep, logprob=dict(fwd_pct_hbm=86.9))) == (
        "best fwd 4096x4w 87.0% HBM; best bwd 8192x8w 75.5% HBM; default fwd 86.9%")
    assert report.headline("kernels", None) == ""


# ------------------------------------------------------------------------------------------
# The check, end to end on CPU.
# ------------------------------------------------------------------------------------------

def _wheel(folder: Path, dist: str, version: str, module: str) -> Path:
    """A minimal pure-Python wheel (no network, no build backend)."""
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{module}/__init__.py", "VALUE = 42\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def _run_check(tmp_path: Path, *args: str, pythonpath: str = "") -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}
    proc = subprocess.run([sys.executable, str(GPU / "check.py"), "--quick", "--out", str(out), *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=240)
    assert (out / "report.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads((out / "report.json").read_text())


needs_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU report; on a GPU run make gpu-check")


@needs_cpu
@pytest.mark.slow
def test_quick_check_on_cpu_installs_wheels_skips_what_needs_cuda_and_reports(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "mrl_check_probe", "0.1", "mrl_check_probe")
    _wheel(wheels, "torch", torch.__version__, "torch")  # already installed at this version: left alone
    site = tmp_path / "site"
    proc, r = _run_check(tmp_path, "--wheels", str(wheels), "--site", str(site))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    assert r["install"]["installed"] == ["mrl_check_probe-0.1-py3-none-any.whl"]
    assert r["install"]["present"] == [f"torch {torch.__version__}"] and not r["install"]["error"]
    assert (site / "mrl_check_probe" / "__init__.py").exists() and not (site / "torch").exists()

    assert r["schema"] == report.SCHEMA and r["mode"] == "quick"
    assert r["device"]["cuda"] is False and r["device"]["name"] == "cpu"
    for key in ("python", "torch", "triton", "megatron-core", "transformers", "liger-kernel", "vllm"):
        assert key in r["versions"], key
    assert r["versions"]["torch"] == torch.__version__

    skipped = {s["what"]: s["why"] for s in r["skipped"]}
    assert "no CUDA device" in skipped["CUDA"] and "--quick" in skipped["tests/kernels"]
    assert skipped["benchmark train_step_qwen2.5-1.5b"].startswith("CUDA absent: no smoke size")
    assert not any(dist in skipped for dist in check.WHEEL_LIST)  # all installed in this environment

    tests = r["tests"]["results"]
    assert tests and all(t["nodeid"].startswith("tests/gpu/") for t in tests)
    assert {t["outcome"] for t in tests} == {"skipped"} and {t["message"] for t in tests} == {"the GPU tier needs CUDA"}
    assert not any(t["nodeid"] in check.BENCH_TESTS for t in tests)  # the benchmark steps replace them

    benches = {b["name"]: b for b in r["benchmarks"]}
    assert list(benches) == [b.name for b in check.BENCHES]
    for name in ("train_step_370m", "kernels", "weights", "rope"):
        b = benches[name]
        assert (b["status"], b["size"], b["figures"]["device"]) == ("ok", "smoke", "cpu"), b
    assert benches["train_step_370m"]["figures"]["mfu"] is None
    assert 0 < benches["weights"]["figures"]["export_over_copy"]
    assert benches["kernels"]["figures"]["logprob"]["max_err"] < 1e-4
    assert benches["train_step_qwen2.5-1.5b"]["status"] == "skipped"

    assert [t["name"] for t in r["targets"]] == [t.name for t in report.TARGETS]
    assert all(t["status"] == "skipped" and t["reason"] for t in r["targets"]), r["targets"]

    md = (tmp_path / "out" / "report.md").read_text()
    for heading in ("# mrl GPU check (quick)", "## Versions", "## Targets", "## Tests", "## Benchmarks", "## Skipped"):
        assert heading in md, heading
    assert "| megatron-core | " in md and "**skipped**" in md
    assert "tokens/s, MFU n/a" in md and "export " in md and " GB/s, ratio " in md  # the benchmarks' headlines


@needs_cpu
@pytest.mark.slow
def test_a_missing_package_is_named_and_what_needs_it_skipped(tmp_path):
    """megatron-core and liger-kernel hidden from the children (as on a bare GPU box)."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\nfrom importlib.machinery import PathFinder\n"
        "class Hiding(PathFinder):\n"
        "    @classmethod\n"
        "    def find_spec(cls, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('megatron', 'liger_kernel'):\n"
        "            return None\n"
        "        return PathFinder.find_spec(name, path, target)\n"
        "sys.meta_path = [Hiding if f is PathFinder else f for f in sys.meta_path]\n")
    proc, r = _run_check(tmp_path, pythonpath=str(hide))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert r["versions"]["megatron-core"] is None and r["versions"]["liger-kernel"] is None
    skipped = {s["what"]: s["why"] for s in r["skipped"]}
    assert skipped["megatron-core"].startswith("not installed (pass --wheels DIR")
    assert skipped["liger-kernel"].startswith("not installed")
    assert skipped["tests/gpu"] == "needs megatron-core"
    benches = {b["name"]: b for b in r["benchmarks"]}
    for name in ("train_step_370m", "weights", "rope"):
        assert (benches[name]["status"], benches[name]["reason"]) == ("skipped", "needs megatron-core"), name
    assert benches["kernels"]["status"] == "ok"  # needs nothing beyond torch
    assert not r["tests"]["ran"]
