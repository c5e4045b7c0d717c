"""What a run ran on: package versions, the mrl install's git commit, the host and the device.

Recorded as MLflow tags (`mrl.env.*`, plus MLflow's own `mlflow.source.git.commit`) when a run
starts, so two runs that differ only in their environment can be told apart.
"""
from __future__ import annotations

import platform
import socket
from importlib import metadata
from pathlib import Path

PACKAGES = {"mrl": "mrl", "torch": "torch", "megatron_core": "megatron-core", "vllm": "vllm",
            "transformers": "transformers", "triton": "triton", "mlflow": "mlflow"}


def package_version(dist_name: str) -> str:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return "not installed"


def mrl_source_dir() -> Path:
    """The directory of the imported mrl package's checkout (its git commit is the code that ran)."""
    import mrl

    return Path(mrl.__file__).resolve().parent.parent


def environment_tags() -> dict[str, str]:
    tags = {f"mrl.env.{key}": package_version(dist) for key, dist in PACKAGES.items()}
    tags["mrl.env.python"] = platform.python_version()
    tags["mrl.env.host"] = socket.gethostname()
    try:
        import torch

        if torch.cuda.is_available():
            tags["mrl.env.device"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
            tags["mrl.env.cuda"] = str(torch.version.cuda)
        else:
            tags["mrl.env.device"] = f"cpu ({platform.machine()})"
    except ImportError:
        pass
    return tags
