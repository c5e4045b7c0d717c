"""`mrl preflight` end to end under torchrun (gloo): the job's model on its real layout."""
import re
import pytest

from tests.dist_util import REPO, run_torchrun

MAIN = "-m mrl"  # not the file: running mrl/__main__.py as a script would put mrl/ on sys.path
LINE = re.compile(r"preflight ok: .* loss (?P<loss>[\d.]+); grad norm (?P<norm>[\d.]+)")


def preflight(*overrides: str) -> dict:
    proc = run_torchrun(MAIN, "preflight", "jobs/quickstart_cpu.toml", *overrides, nproc=2, timeout=240)
    m = LINE.search(proc.stdout)
    assert m, proc.stdout + proc.stderr
    return {k: float(v) for k, v in m.groupdict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("model", ["builtin:tiny-qwen2", "builtin:tiny-llama"])
def test_tp2_equals_tp1(model):
    # Same seed -> same full weights at any TP size (megatron draws full tensors, keeps a shard):
    # the loss and the model's global gradient norm must agree.
    tp1 = preflight("parallel.tensor=1", f"model.path={model}")
    tp2 = preflight("parallel.tensor=2", f"model.path={model}")
    assert tp2["loss"] == pytest.approx(tp1["loss"], rel=1e-5)
    assert tp2["norm"] == pytest.approx(tp1["norm"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ("parallel.tensor=1", "parallel.pipeline=2"),
    ("parallel.tensor=1", "parallel.expert=2", "model.path=builtin:tiny-qwen3-moe"),
])
def test_pipeline_and_expert_layouts_run(overrides):
    out = preflight(*overrides)
    assert 5.0 < out["loss"] < 7.5  # ~log(512) for a random model on random tokens
    assert out["norm"] > 0


@pytest.mark.slow
def test_bad_spec_fails_every_rank_without_traceback():
    import subprocess
    import sys
    from tests.dist_util import free_port

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), "-m", "mrl", "preflight", "jobs/quickstart_cpu.toml", "parallel.tensor=3"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    # every rank fails; the lowest one prints the line
    assert proc.stderr.count("parallel.tensor: 3 does not divide the 4 attention heads") == 1, proc.stderr
    assert "mrl/cli/" not in proc.stderr  # no traceback from mrl for a user error
