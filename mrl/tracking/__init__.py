"""mrl.tracking: console progress and MLflow for the trainer (`mrl.tracking.tracker.Tracker`)."""
