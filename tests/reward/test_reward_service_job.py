"""A GRPO job on 2 CPU ranks whose rewards come from a local HTTP reward service the test starts
(`reward.url`), which dies mid-run, and a judge model (a tiny random model on CPU) whose
unparsable answers are counted. The run finishes; the dead service costs counted errors and one
line per step. (The chat-completions judge is tested against a local server in
test_reward_services.py.)"""
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist_util import REPO, run_torchrun
from tests.train.test_train import history

SERVICES = Path(__file__).with_name("fake_services.py")


def start(kind: str, tmp_path: Path, *args: str) -> tuple[subprocess.Popen, str]:
    port_file = tmp_path / f"{kind}.url"
    proc = subprocess.Popen([sys.executable, str(SERVICES), kind, str(port_file), *args], cwd=REPO)
    deadline = time.monotonic() + 30
    while not (port_file.exists() and port_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc, port_file.read_text()


@pytest.mark.slow
def test_job_trains_on_a_reward_service_that_dies_and_a_tiny_judge_model(tmp_path):
    # 8 prompts x 8 responses = 64 responses a step, 16 per request: the service answers steps 1-3
    service, url = start("digits", tmp_path, "12")
    sources = (f'[{{name="remote",url="{url}/score",weight=1.0}},'
               f'{{name="judge",judge=true,weight=0.5}}]')
    try:
        proc = run_torchrun("-m mrl train", "jobs/quickstart_cpu.toml", f"job.output_dir={tmp_path}", "job.name=run",
                            "trainer.total_steps=5", "checkpoint.every_steps=0", "tracking.backends=[\"mlflow\"]",
                            "reward.function=none", f"reward.sources={sources}",
                            "reward.judge.model=builtin:tiny-qwen2", "reward.judge.max_tokens=4",
                            "reward.remote.batch_size=16", "reward.remote.retries=2", "reward.remote.backoff_s=0.1",
                            timeout=600)
    finally:
        service.kill()
        service.wait()
    assert service.returncode == 0   # it exited by itself after its 12th answer
    h = history(tmp_path / "run")
    assert sorted(h["reward/mean"]) == [1, 2, 3, 4, 5]
    errors = h.get("reward/remote/errors/connection", {})
    assert all(errors.get(s, 0.0) == 0.0 for s in (1, 2, 3)) and all(errors[s] == 64.0 for s in (4, 5)), errors
    assert all(0.0 <= h["reward/remote/mean"][s] <= 1.0 for s in (1, 2, 3))
    parse = h.get("reward/judge/errors/parse", {})
    assert sum(parse.values()) > 0, "a random judge's answers are mostly not numbers: counted as parse errors"
    assert all(v <= 64 for v in parse.values())
    lines = [line for line in proc.stderr.splitlines() if "cannot be reached" in line]
    assert len(lines) == 2 and all(url in line for line in lines), lines   # one line a step, naming the URL
    assert "Traceback" not in proc.stderr
