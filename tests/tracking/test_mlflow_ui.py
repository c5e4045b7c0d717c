"""MLflow's UI: the addresses a run prints, the saved chart layout (reward first), and, in a real
browser (headless Chromium), that the printed command and addresses open the training charts."""
from __future__ import annotations

import asyncio
import io
import os
import shlex
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from mrl.tracking import mlflow_ui
from mrl.tracking.config import TrackingConfig
from mrl.tracking.mlflow_ui import (HEADLINE_GROUP, VIEW_KEY, VIEW_NAME, VIEW_TAG, chart_layout, charts_address,
                                    decode_view, run_address, ui_base, ui_command, view_tag_value)
from mrl.tracking.startup import RunSummary
from mrl.tracking.tracker import Tracker
from tests.dist_util import free_port, run_torchrun
from tests.tracking import chromium


def test_the_command_and_addresses_of_a_local_store_and_of_a_server():
    uri = "sqlite:////runs/my runs/mlflow.db"
    assert ui_command(uri) == "mlflow ui --backend-store-uri 'sqlite:////runs/my runs/mlflow.db'"
    assert shlex.split(ui_command(uri))[-1] == uri
    assert ui_command("sqlite:////r/mlflow.db") == "mlflow ui --backend-store-uri sqlite:////r/mlflow.db"
    assert ui_base(uri, env={}) == "http://127.0.0.1:5000"
    # `mlflow ui` reads MLFLOW_HOST / MLFLOW_PORT / MLFLOW_STATIC_PREFIX; listening everywhere is reached on loopback
    assert ui_base(uri, env={"MLFLOW_PORT": "8123", "MLFLOW_STATIC_PREFIX": "/mlflow/"}) == "http://127.0.0.1:8123/mlflow"
    assert ui_base(uri, env={"MLFLOW_HOST": "0.0.0.0"}) == "http://127.0.0.1:5000"
    assert ui_base(uri, env={"MLFLOW_HOST": "::1"}) == "http://[::1]:5000"
    # a tracking server serves its own UI; Databricks has neither
    assert ui_command("https://mlflow.example.com/") is None
    assert ui_base("https://mlflow.example.com/", env={"MLFLOW_PORT": "1"}) == "https://mlflow.example.com"
    assert ui_command("databricks") is None and ui_base("databricks", env={}) is None
    base = "http://127.0.0.1:5000"
    assert charts_address(base, "3") == ("http://127.0.0.1:5000/#/experiments/3/runs?workflowType=machine_learning"
                                         "&compareRunsMode=CHART&viewStateShareKey=mrl-charts")
    assert run_address(base, "3", "abc") == ("http://127.0.0.1:5000/#/experiments/3/runs/abc/model-metrics"
                                             "?workflowType=machine_learning")


def test_the_layout_puts_the_headline_first_then_each_group_by_name():
    keys = ["time/step", "actor/pg_approx_kl", "actor/entropy", "reward/mean", "reward/std", "zeta", "rollout/kl_k3",
            "reward/score/mean", "advantage/mean", "system/cpu"]
    state = chart_layout(keys)
    groups = [s["name"] for s in state["compareRunSections"]]
    # MLflow's own order ("actor" first) would bury the reward; "Model metrics" and "System metrics" stay last
    assert groups == [HEADLINE_GROUP, "actor", "advantage", "reward", "reward/score", "Model metrics", "System metrics"]
    assert state["isAccordionReordered"] is True   # MLflow keeps the saved group order only with this
    ids = {s["uuid"]: s["name"] for s in state["compareRunSections"]}
    charts = [(ids[c["metricSectionId"]], c["metricKey"]) for c in state["compareRunCharts"]]
    # every headline chart, logged or not (MLflow hides a chart while it has no data: `hideEmptyCharts`)
    assert charts == [*(("headline", k) for k in mlflow_ui.HEADLINE_CHARTS),
                      ("actor", "actor/entropy"), ("advantage", "advantage/mean"), ("reward", "reward/std"),
                      ("reward/score", "reward/score/mean"), ("Model metrics", "zeta"), ("System metrics", "system/cpu")]
    assert mlflow_ui.HEADLINE_CHARTS[:2] == ("reward/mean", "val/reward_mean") and "time/step" in mlflow_ui.HEADLINE_CHARTS
    # headline charts carry their full key as title, the others their last part (as MLflow names them)
    titles = [c["displayName"] for c in state["compareRunCharts"]]
    assert titles[:2] == ["reward/mean", "val/reward_mean"] and "entropy" in titles
    assert {c["type"] for c in state["compareRunCharts"]} == {"LINE"}
    # before any metric: the headline charts alone
    empty = chart_layout(())
    assert [c["metricKey"] for c in empty["compareRunCharts"]] == list(mlflow_ui.HEADLINE_CHARTS)
    assert empty["hideEmptyCharts"] is True and [s["name"] for s in empty["compareRunSections"]] == [HEADLINE_GROUP]
    assert chart_layout(keys) == state   # stable ids: a rewritten layout is the same layout


def test_the_saved_view_is_the_envelope_the_ui_reads_and_fits_in_a_tag(monkeypatch):
    import json

    value = view_tag_value(["reward/mean", "actor/entropy"], now_ms=2000, created_ms=1000)
    envelope = json.loads(value)
    assert envelope["name"] == VIEW_NAME and envelope["createdAt"] == 1000 and envelope["updatedAt"] == 2000
    assert envelope["state"].startswith("deflate;")   # the UI's compressed form (zlib deflate, base64)
    assert decode_view(value) == chart_layout(["reward/mean", "actor/entropy"])
    many = [f"g{i}/metric_with_a_long_name_{j}" for i in range(60) for j in range(20)]
    big = view_tag_value(many, now_ms=1)
    assert len(big) <= mlflow_ui.MAX_TAG_CHARS
    # 1200 charts do not fit: the headline charts and every group are listed, MLflow adds the rest
    state = decode_view(big)
    assert len(state["compareRunSections"]) == 61 and len(state["compareRunCharts"]) == len(mlflow_ui.HEADLINE_CHARTS)
    monkeypatch.setattr(mlflow_ui, "MAX_TAG_CHARS", 1500)   # not even the groups: the headline group alone
    assert [s["name"] for s in decode_view(view_tag_value(many, now_ms=1))["compareRunSections"]] == [HEADLINE_GROUP]


def test_a_run_saves_the_layout_and_prints_where_its_charts_are(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_PORT", "5123")
    stream = io.StringIO()
    uri = f"sqlite:///{tmp_path / 'a store' / 'mlflow.db'}"
    t = Tracker(TrackingConfig(backends=("mlflow",), tracking_uri=uri), run_dir=tmp_path / "r", total_steps=2,
                rank=0, stream=stream)
    client = MlflowClient(tracking_uri=uri)
    exp, run = t.mlflow.experiment_id, t.run_id
    first = client.get_experiment(exp).tags[VIEW_TAG]
    assert [s["name"] for s in decode_view(first)["compareRunSections"]] == [HEADLINE_GROUP]   # before any step
    t.log_metrics({"reward/mean": 0.5, "actor/entropy": 1.0}, step=1)
    after = client.get_experiment(exp).tags[VIEW_TAG]
    time.sleep(0.01)
    t.log_metrics({"reward/mean": 0.6, "actor/entropy": 0.9}, step=2)   # no new key: not rewritten
    assert client.get_experiment(exp).tags[VIEW_TAG] == after
    assert decode_view(after) == chart_layout(["reward/mean", "actor/entropy"])
    t.log_metrics({"reward/mean": 0.7, "val/reward_mean": 0.4, "val/responses": 8}, step=3)   # new keys: rewritten
    state = decode_view(client.get_experiment(exp).tags[VIEW_TAG])
    assert state == chart_layout(["reward/mean", "actor/entropy", "val/reward_mean", "val/responses"])
    assert "val" in [s["name"] for s in state["compareRunSections"]]
    import json

    assert json.loads(client.get_experiment(exp).tags[VIEW_TAG])["createdAt"] == json.loads(first)["createdAt"]
    t.finish()
    lines = stream.getvalue().splitlines()
    assert lines[1] == f"metrics: mlflow ui --backend-store-uri {shlex.quote(uri)}   (run {run})"
    assert lines[2] == f"charts: http://127.0.0.1:5123/#/experiments/{exp}/runs?workflowType=machine_learning" \
                       f"&compareRunsMode=CHART&viewStateShareKey={VIEW_KEY}"
    assert lines[3] == f"run: http://127.0.0.1:5123/#/experiments/{exp}/runs/{run}/model-metrics?workflowType=machine_learning"
    assert t.ui_addresses == lines[2:4]


def test_the_summary_quotes_paths_and_ends_with_the_addresses():
    lines = RunSummary().lines(steps=1, wall_s=1, checkpoint="/r s/c", run_dir="runs/my run",
                               tracking_uri="sqlite:////runs/my run/mlflow.db", addresses=["charts: A", "run: B"])
    assert lines[1] == ("next: mrl merge 'runs/my run' 'runs/my run/hf'   mrl compare 'runs/my run'   "
                        "mlflow ui --backend-store-uri 'sqlite:////runs/my run/mlflow.db'")
    assert lines[2:] == ["charts: A", "run: B"]
    assert RunSummary().lines(steps=1, wall_s=1, checkpoint=None, run_dir="d",
                              tracking_uri="http://server:5000")[1] == "next: mrl compare d"


# --- in a real browser ------------------------------------------------------------------------

FIRST_CARD = """(() => {
  const header = document.querySelector('[data-testid=experiment-view-compare-runs-section-header]');
  const card = document.querySelector('[data-testid=experiment-view-compare-runs-card]');
  const line = card && card.querySelector('.js-line');
  if (!line || !(line.getAttribute('d') || '').startsWith('M')) return null;
  const plot = card.querySelector('svg.main-svg').getBoundingClientRect();
  return {group: header.innerText.split('\\n')[0], title: card.innerText.split('\\n')[0], d: line.getAttribute('d'),
          stroke: getComputedStyle(line).stroke, plot: [plot.x, plot.y, plot.width, plot.height],
          href: location.href, cards: document.querySelectorAll('[data-testid=experiment-view-compare-runs-card]').length};
})()"""

# the run's own page: its groups, and the chart of reward/mean (legend "<run> (reward/mean)") once scrolled to
RUN_PAGE_REWARD = """(() => {
  const headers = [...document.querySelectorAll('[data-testid=experiment-view-compare-runs-section-header]')];
  const reward = headers.find(h => h.innerText.split('\\n')[0] === 'reward');
  if (!reward) return null;
  reward.scrollIntoView();
  const card = [...document.querySelectorAll('[data-testid=experiment-view-compare-runs-card]')]
    .find(c => c.innerText.includes('(reward/mean)'));
  const line = card && card.querySelector('.js-line');
  if (!line || !(line.getAttribute('d') || '').startsWith('M')) return null;
  return {groups: headers.map(h => h.innerText.split('\\n')[0]), title: card.innerText.split('\\n')[0],
          d: line.getAttribute('d'), mode: document.body.innerText.includes('Model training')};
})()"""


def _coloured_pixels(png: Path, rect, rgb: tuple[int, int, int], scale: float) -> int:
    """Coloured pixels of `png` inside `rect` (CSS pixels: x, y, w, h) within 40 of `rgb` on each
    channel (grey ones, the background, grid and axes, are not counted)."""
    from PIL import Image

    img = Image.open(png).convert("RGB")
    x, y, w, h = (round(v * scale) for v in rect)
    box = img.crop((x, y, x + w, y + h))
    return sum(1 for p in box.getdata() if max(p) - min(p) >= 30 and all(abs(a - b) <= 40 for a, b in zip(p, rgb)))


def _wait_for_http(url: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"mlflow ui exited {proc.returncode}"
        try:
            urllib.request.urlopen(url, timeout=5).read(100)
            return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"mlflow ui did not answer at {url} in {timeout_s}s")


@pytest.mark.slow
def test_the_printed_addresses_open_the_training_charts_with_the_reward_first(tmp_path):
    """A 2-step run prints the `mlflow ui` command and two addresses; the command, pasted, serves the
    store, and in headless Chromium the charts address shows the model training runs view whose first
    chart is the reward, drawn (its line in the screenshot's pixels); the run address shows the run's charts."""
    if chromium.executable() is None:
        message = "no chromium: `apt-get install chromium` (.ci/run installs it for `make test`)"
        if os.environ.get("MRL_REQUIRE_CHROMIUM") == "1":
            pytest.fail(message + " [MRL_REQUIRE_CHROMIUM=1]")
        pytest.skip(message)
    port = free_port()
    out = tmp_path / "my runs"   # a path with a space: the printed command quotes it
    mlflow_env = {"MLFLOW_PORT": str(port), "MLFLOW_WORKERS": "1", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = run_torchrun("-m mrl train", "jobs/quickstart_cpu.toml", "platform.ranks_per_node=1", "parallel.tensor=1",
                        "trainer.total_steps=2", "checkpoint.every_steps=0", f"job.output_dir={out}", nproc=1,
                        timeout=600, env=mlflow_env)
    lines = proc.stdout.splitlines()
    command = next(line for line in lines if line.startswith("metrics: mlflow ui ")).split(": ", 1)[1]
    command = command.rsplit("   (run ", 1)[0]
    charts = next(line for line in lines if line.startswith("charts: ")).split(": ", 1)[1]
    run_url = next(line for line in lines if line.startswith("run: ")).split(": ", 1)[1]
    assert lines[-2:] == [f"charts: {charts}", f"run: {run_url}"]   # the closing summary repeats them
    assert charts.startswith(f"http://127.0.0.1:{port}/#/experiments/")

    import sys

    argv = shlex.split(command)
    assert argv[:3] == ["mlflow", "ui", "--backend-store-uri"] and argv[3] == f"sqlite:///{out / 'mlflow.db'}"
    server = subprocess.Popen([sys.executable, "-m", "mlflow", *argv[1:]], env={**os.environ, **mlflow_env},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_for_http(f"http://127.0.0.1:{port}/health", server)
        shot = asyncio.run(_browse(charts, run_url, tmp_path))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)
    print(f"screenshot: {shot}")


async def _browse(charts: str, run_url: str, tmp_path: Path) -> Path:
    async with chromium.Page(tmp_path / "profile") as page:
        await page.open(charts)
        first = await page.wait_for(FIRST_CARD, timeout_s=180)
        assert first["group"] == HEADLINE_GROUP and first["title"] == "reward/mean", first
        assert "/runs?" in first["href"] and "workflowType=machine_learning" in first["href"]   # not the GenAI view
        assert first["d"].count(",") >= 2   # a line through the 2 steps' points
        assert "Model training" in await page.eval("document.body.innerText")
        shot = await page.screenshot(tmp_path / "charts.png")
        scale = await page.eval("window.devicePixelRatio")
        rgb = tuple(int(v) for v in first["stroke"].removeprefix("rgb(").rstrip(")").split(","))
        assert _coloured_pixels(shot, first["plot"], rgb, scale) >= 20, first   # the line is in the pixels

        await page.open(run_url)
        run = await page.wait_for(RUN_PAGE_REWARD, timeout_s=180)
        assert run["mode"] and run["title"] == "mean" and run["d"].count(",") >= 2, run
        # MLflow orders a run page's groups by name (its layout lives in the browser): the reward is not first
        named = [g for g in run["groups"] if g not in ("Model metrics", "System metrics")]
        assert named == sorted(named) and named[0] != "reward", run
        await page.screenshot(tmp_path / "run.png")
    return shot
