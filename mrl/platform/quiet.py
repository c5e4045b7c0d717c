"""Known, harmless third-party warnings silenced in one place (no heavy imports here: the CLI
calls it before anything else)."""
from __future__ import annotations

# Warnings megatron-core and torch print on every run without Transformer Engine / Apex (CPU, or a
# GPU box without them): expected, not actionable, and they bury the one-line user errors.
KNOWN_WARNINGS = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
    r"`load_state_dict` is deprecated and will be removed",
    r"Please use DTensor instead and we are deprecating ShardedTensor",
)


# Loggers whose INFO lines are routine set-up, not news: MLflow creating or migrating its sqlite
# tables on a new store.
QUIET_LOGGERS = ("mlflow.store.db.utils", "alembic")


def quiet_known_warnings() -> None:
    import logging
    import os
    import warnings

    for message in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    # What megatron-core asks for with tensor-parallel async gradient all-reduce (it warns once per
    # rank otherwise): one CUDA work queue, so communication kernels run in launch order. No effect
    # on CPU; set before any CUDA context exists (an explicit value in the environment wins).
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # MLflow draws a download progress bar each time a sample table is appended to.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
