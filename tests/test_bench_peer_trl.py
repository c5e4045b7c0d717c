"""tools/bench/peer_trl.py without running either trainer: TRL's pins and the side-by-side report."""
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("peer_trl", REPO / "tools" / "bench" / "peer_trl.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_trls_venv_takes_mrls_pins_of_the_shared_packages_and_trl_1_16():
    pins = _bench().pins()
    constraints = (REPO / "constraints.txt").read_text().splitlines()
    for name in ("torch", "transformers", "accelerate", "numpy"):
        [pin] = [p for p in pins if p.startswith(name + "==")]
        assert pin in constraints
    assert "trl==1.16.0" in pins and "reasoning_gym==0.1.25" in pins


def test_the_report_prints_seconds_per_step_the_ratio_and_rewards():
    bench = _bench()
    r = {"load_before": (1.5, 1, 1), "load_after": (2.5, 1, 1),
         "mrl": {"steps": [{"step": 1, "seconds": 40.0, "reward": 0.25}, {"step": 2, "seconds": 30.0, "reward": 0.5}]},
         "trl": {"steps": [{"step": 1, "seconds": 80.0, "reward": 0.2}, {"step": 2, "seconds": 60.0, "reward": 0.3}],
                 "dropped_config": ["top_k"]}}
    text = bench.report(r)
    assert "TRL / mrl: 2.00x (all steps), 2.00x (after the first)" in text
    assert "0.250 0.500" in text and "0.200 0.300" in text and "load average 1.50 before, 2.50 after" in text
    assert "no top_k" in text


def test_the_report_breaks_each_step_down_and_bounds_the_ratio_by_the_update():
    """After the first step: mrl 30 s = rollout 8 + update 18 + sync 1 + 3 other; TRL 60 s =
    generate 40 + update 20. With mrl's rollout and sync free, TRL / mrl <= 60 / (30 - 8 - 1)."""
    bench = _bench()
    first = {"step": 1, "seconds": 99.0, "reward": 0.0}
    r = {"load_before": (1, 1, 1), "load_after": (1, 1, 1),
         "mrl": {"steps": [first, {"step": 2, "seconds": 30.0, "reward": 0.5, "generate": 8.0, "update": 18.0,
                                   "weight sync": 1.0}]},
         "trl": {"steps": [first, {"step": 2, "seconds": 60.0, "reward": 0.3, "generate": 40.0, "update": 20.0}]}}
    text = bench.report(r)
    assert "  mrl                 8.0         18.0          1.0          3.0" in text
    assert "  TRL 1.16           40.0         20.0          0.0          0.0" in text
    assert "generate 5.00x, update 1.11x; with mrl's rollout and sync free, TRL / mrl would be at most 2.86x" in text
