"""How an mrl experiment presents itself in the MLflow UI.

The experiment is tagged a model training experiment (`mlflow.experimentKind` =
"custom_model_development", the value MLflow's UI writes when a user sets the kind). The UI of
MLflow 3.17.2 (pinned) does not choose its view by that tag: it opens the GenAI view (traces,
judges, prompts) unless the address carries `workflowType=machine_learning` or the user switched
to "Model training", so mrl prints such addresses (`mrl.tracking.mlflow_ui`). A new sqlite store
also gets MLflow's "Default" experiment (id 0), whose artifacts would go to `./mlruns` of whatever
directory the store was opened from; mrl never logs to it, so an empty one is deleted (MLflow
keeps it as deleted, hidden in the UI) instead of sitting next to the job's experiment.
"""
from __future__ import annotations

KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"


def declare_training_experiment(client, experiment_id: str) -> None:
    """Tag the experiment as a training experiment, unless someone already chose its kind."""
    exp = client.get_experiment(experiment_id)
    if KIND_TAG not in exp.tags:
        client.set_experiment_tag(experiment_id, KIND_TAG, TRAINING_KIND)


def hide_empty_default_experiment(client) -> bool:
    """Delete MLflow's "Default" experiment when it is active and holds no run; True if it did."""
    from mlflow.exceptions import MlflowException

    try:
        exp = client.get_experiment("0")
    except MlflowException:
        return False
    if exp.name != "Default" or exp.lifecycle_stage != "active":
        return False
    if client.search_runs(["0"], max_results=1, run_view_type=3):   # 3: active and deleted runs
        return False
    client.delete_experiment("0")
    return True
