"""After a resume with changed overrides the run says what ran: spec.toml (what `mrl compare`
reads) is the new spec, the old one is kept, and the changed params are listed."""
import io

from mlflow.tracking import MlflowClient

from mrl.compare.data import run_params
from mrl.compare.select import RunRef, Stores
from mrl.config.loader import load
from mrl.tracking.tracker import Tracker


def test_a_resume_with_more_steps_records_the_new_spec_and_keeps_the_old(tmp_path):
    first, _ = load("jobs/quickstart_cpu.toml", [f"job.output_dir={tmp_path}", "trainer.total_steps=3",
                                                 'tracking.backends=["mlflow"]'])
    tracker = Tracker.from_spec(first, total_steps=3, rank=0, stream=io.StringIO())
    tracker.log_spec(first)
    run_id, uri = tracker.run_id, tracker.mlflow.tracking_uri
    tracker.finish()
    later, _ = load("jobs/quickstart_cpu.toml", [f"job.output_dir={tmp_path}", "trainer.total_steps=5",
                                                 'tracking.backends=["mlflow"]'])
    resumed = Tracker.from_spec(later, total_steps=5, rank=0, stream=io.StringIO(), resume_run_id=run_id,
                                start_step=3)
    resumed.log_resumed_spec(later, 3)
    resumed.log_resumed_spec(later, 3)   # the same spec again: nothing more kept
    resumed.finish()

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.data.tags["mrl.spec_changed_at_step"] == "3"
    assert "trainer.total_steps" in run.data.tags["mrl.resume_changed_params"].split(",")
    assert run_params(Stores(), RunRef(uri, run_id, "quickstart-cpu", "mrl", "FINISHED"))["trainer.total_steps"] == "5"
    kept = [a.path for a in client.list_artifacts(run_id, "spec_history")]
    assert kept == ["spec_history/spec_before_step_3.toml"]
    old = open(client.download_artifacts(run_id, kept[0], str(tmp_path / "dl"))).read()
    assert "total_steps = 3" in old
