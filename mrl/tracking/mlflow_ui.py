"""Where a run's charts are in MLflow's UI, and the chart layout its experiment opens with.

What MLflow 3.17.2's UI reads (its bundle, `mlflow/server/js/build/static/js/`):

- GenAI view or model training view: the `workflowType` query parameter of the address
  (`genai` | `machine_learning`), else the browser's local storage (`mlflow.workflowType`, set by
  the "GenAI / Model training" switch), else `genai` (main.*.js, module 7975). The experiment tag
  `mlflow.experimentKind` does not decide it: the experiment kind follows the workflow type
  (module 31080 `Fi`, behind the flag `Z0` of module 89511, which is on), and the experiment page
  opens on the "runs" tab only for the model training kind (experimentPage.*.js, module 24546).
  So no store setting makes the list of experiments open a training view; an address with
  `?workflowType=machine_learning` does, and so does switching to "Model training" once.
- In the GenAI view, runs without logged-model outputs are "Evaluation runs" (module 58464).
- Chart groups are the metric key before its last `/`, sorted by name, and "Model metrics" (keys
  without `/`) last (module 63989, `getBaseChartAndSectionConfigs`). A run's own page keeps its
  layout in the browser only (9930.*.chunk.js, `RunPage` store), so its groups come in that order.
- The runs view of an experiment opens a saved layout named in the address by
  `viewStateShareKey=KEY`: the experiment tag `mlflow.sharedViewState.KEY`, a JSON envelope
  `{name, createdAt, updatedAt, state}` whose `state` is the view's JSON or `deflate;` + base64 of
  its zlib deflate (3878.*.chunk.js `Ia`, 3448.*.chunk.js module 53787, main module 58180); the
  runs tab lists it under its name among the saved views. Its chart groups keep the saved order
  when `isAccordionReordered` is set, and charts of metrics it does not list are added to the
  group of their prefix (module 63989, `updateChartAndSectionConfigs`).

mrl saves such a layout in its experiment: a "headline" group first (reward, validation reward,
KL, train/inference mismatch, step time, SFT loss), then every other group by name, and prints
the addresses that open it and the run's own charts.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import shlex
import zlib
from typing import Iterable, Mapping

# the charts of the first group, in this order (those a run did not log are hidden: `hideEmptyCharts`)
HEADLINE_CHARTS = (
    "reward/mean", "val/reward_mean",
    "actor/kl_loss", "kl/reward_kl", "actor/pg_approx_kl",      # the KL the run optimises against, else the approximate KL
    "rollout/kl_k3", "rollout/logprob_abs_diff_mean",            # train/inference mismatch
    "time/step",
    "train/loss", "val/loss", "time/step_s",                     # mrl sft
)
HEADLINE_GROUP = "headline"
VIEW_KEY = "mrl-charts"                       # the layout's share key (the address's viewStateShareKey)
VIEW_TAG = "mlflow.sharedViewState." + VIEW_KEY
VIEW_NAME = "mrl: reward first"               # its name in the runs tab's saved views
MAX_TAG_CHARS = 20000                         # MLflow's limit on an experiment tag's value
_MODEL_METRICS, _SYSTEM_METRICS = "Model metrics", "System metrics"
_LOCAL_DEFAULT = ("127.0.0.1", "5000")        # where `mlflow ui` listens by default
_DEFLATE = "deflate;"                         # the UI's mark of a compressed text


def ui_command(tracking_uri: str) -> str | None:
    """The command that serves a store's UI (`mlflow ui --backend-store-uri URI`, the URI quoted for
    the shell); None for a tracking server (it serves its own UI) and Databricks."""
    if _server(tracking_uri) is not None or tracking_uri.startswith("databricks"):
        return None
    return f"mlflow ui --backend-store-uri {shlex.quote(tracking_uri)}"


def ui_base(tracking_uri: str, env: Mapping[str, str] | None = None) -> str | None:
    """The UI's root: a tracking server's own address, else where `mlflow ui` listens
    (`MLFLOW_HOST`, `MLFLOW_PORT`, `MLFLOW_STATIC_PREFIX` as `mlflow ui` reads them, default
    http://127.0.0.1:5000); None for Databricks."""
    server = _server(tracking_uri)
    if server is not None:
        return server
    if tracking_uri.startswith("databricks"):
        return None
    env = os.environ if env is None else env
    host = env.get("MLFLOW_HOST") or _LOCAL_DEFAULT[0]
    if host in ("0.0.0.0", "::", "[::]"):     # listening everywhere: this host reaches it on loopback
        host = _LOCAL_DEFAULT[0]
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    prefix = (env.get("MLFLOW_STATIC_PREFIX") or "").rstrip("/")
    return f"http://{host}:{env.get('MLFLOW_PORT') or _LOCAL_DEFAULT[1]}{prefix}"


def _server(tracking_uri: str) -> str | None:
    if tracking_uri.lower().startswith(("http://", "https://")):
        return tracking_uri.rstrip("/")
    return None


def charts_address(base: str, experiment_id: str) -> str:
    """The experiment's runs, as charts, in the saved layout (reward first)."""
    return (f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning&compareRunsMode=CHART"
            f"&viewStateShareKey={VIEW_KEY}")


def run_address(base: str, experiment_id: str, run_id: str) -> str:
    """The run's own page, on its metric charts."""
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}/model-metrics?workflowType=machine_learning"


def _id(kind: str, name: str) -> str:
    """A stable id for a chart or group, so a rewritten layout keeps its ids."""
    return f"mrl-{kind}-" + hashlib.sha1(name.encode()).hexdigest()[:16]


def _group(key: str) -> str:
    """MLflow's chart group of a metric key: the part before its last `/`, "Model metrics" without
    one, "System metrics" for `system/NAME` (module 63989, `extractChartSectionName`)."""
    head = key.rpartition("/")[0]
    return _MODEL_METRICS if not head else _SYSTEM_METRICS if head == "system" else head


def _line_chart(key: str, group: str, display_name: str) -> dict:
    """A line chart card as the UI makes one for a metric (module 63989, class of type LINE)."""
    return {"uuid": _id("chart", key), "type": "LINE", "runsCountToCompare": 10, "metricSectionId": _id("group", group),
            "deleted": False, "isGenerated": True, "displayName": display_name, "metricKey": key, "lineSmoothness": 0,
            "xAxisScaleType": "linear", "scaleType": "linear", "range": {}, "xAxisKey": "step",
            "selectedXAxisMetricKey": "", "yAxisKey": "metric", "yAxisExpressions": [], "ignoreOutliers": False,
            "useGlobalXaxisKey": True, "useGlobalLineSmoothing": True}


def chart_layout(metric_keys: Iterable[str], *, all_charts: bool = True) -> dict:
    """The runs view's state: the headline group, then each other group by name ("Model metrics"
    and "System metrics" last, as MLflow orders them), each group's charts by name.
    `all_charts=False` lists only the headline charts (MLflow adds the others to their groups)."""
    keys = sorted(set(metric_keys) | set(HEADLINE_CHARTS))
    headline = [k for k in HEADLINE_CHARTS if k in keys]
    rest = [k for k in keys if k not in HEADLINE_CHARTS]
    groups = sorted({_group(k) for k in rest} - {_MODEL_METRICS, _SYSTEM_METRICS})
    groups = [HEADLINE_GROUP, *groups, *[g for g in (_MODEL_METRICS, _SYSTEM_METRICS) if g in {_group(k) for k in rest}]]
    charts = [_line_chart(k, HEADLINE_GROUP, k) for k in headline]
    if all_charts:
        charts += [_line_chart(k, _group(k), k.rpartition("/")[2]) for g in groups[1:] for k in rest if _group(k) == g]
    sections = [{"uuid": _id("group", g), "name": g, "display": True, "isReordered": g == HEADLINE_GROUP,
                 "deleted": False, "isGenerated": True} for g in groups]
    return {"compareRunCharts": charts, "compareRunSections": sections, "isAccordionReordered": True,
            "hideEmptyCharts": True}


def _compress(text: str) -> str:
    """The UI's compressed text: `deflate;` + base64 of zlib's deflate (pako's `deflate`)."""
    return _DEFLATE + base64.b64encode(zlib.compress(text.encode(), 9)).decode()


def decode_view(value: str) -> dict:
    """The state of a saved-view tag value (what the UI reads back)."""
    state = json.loads(value)["state"]
    if state.startswith(_DEFLATE):
        state = zlib.decompress(base64.b64decode(state[len(_DEFLATE):])).decode()
    return json.loads(state)


def view_tag_value(metric_keys: Iterable[str], *, now_ms: int, created_ms: int | None = None) -> str:
    """The value of `VIEW_TAG`: the saved view of `chart_layout(metric_keys)`; when every chart
    would not fit in a tag, only the headline charts are listed (MLflow adds the others), and
    when the groups do not fit either, only the headline group."""
    keys = list(metric_keys)
    for state in (chart_layout(keys), chart_layout(keys, all_charts=False), chart_layout(())):
        text = _compress(json.dumps(state, separators=(",", ":")))
        value = json.dumps({"name": VIEW_NAME, "createdAt": created_ms or now_ms, "updatedAt": now_ms, "state": text})
        if len(value) <= MAX_TAG_CHARS:
            break
    return value
