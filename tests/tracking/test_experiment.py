"""The MLflow UI opens an mrl experiment as a training experiment, and no stray "Default" one."""
import io

from mlflow.tracking import MlflowClient

from mrl.tracking.config import TrackingConfig
from mrl.tracking.experiment import KIND_TAG, TRAINING_KIND
from mrl.tracking.tracker import Tracker


def test_the_experiment_declares_itself_a_training_experiment_and_default_is_gone(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = TrackingConfig(backends=("mlflow",), experiment="rl", tracking_uri=uri)
    tracker = Tracker(cfg, run_dir=tmp_path / "run", total_steps=1, rank=0, stream=io.StringIO())
    tracker.finish()
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("rl")
    assert exp.tags[KIND_TAG] == TRAINING_KIND == "custom_model_development"
    assert [e.name for e in client.search_experiments()] == ["rl"]   # "Default" (./mlruns) deleted
    assert client.get_experiment("0").lifecycle_stage == "deleted"


def test_a_kind_someone_chose_and_a_default_experiment_with_runs_are_left_alone(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    client.create_run("0")   # someone logged to Default
    exp_id = client.create_experiment("rl")
    client.set_experiment_tag(exp_id, KIND_TAG, "finetuning")
    cfg = TrackingConfig(backends=("mlflow",), experiment="rl", tracking_uri=uri)
    Tracker(cfg, run_dir=tmp_path / "run", total_steps=1, rank=0, stream=io.StringIO()).finish()
    assert client.get_experiment(exp_id).tags[KIND_TAG] == "finetuning"
    assert client.get_experiment("0").lifecycle_stage == "active"
