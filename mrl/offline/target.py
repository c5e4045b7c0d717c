"""What `mrl eval` / `mrl generate` load: the job spec and the checkpoint step directory.

`JOB|RUN_DIR`: a job file (its checkpoints are under `checkpoint.dir`/actor) or a run directory
(`<job.output_dir>/<job.name>`, whose checkpoints record the spec they were trained with). The
step is the latest committed one, or `--step N`; a job file with no checkpoint falls back to
its `model.path` (a run directory without one is an error: there is nothing to evaluate).
The recorded spec is read only after the step directory matched its manifest, through the
restricted `common.pt` reader (`mrl.checkpoint.trust`).
"""
from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any, Optional

from mrl.errors import UserError


@dataclasses.dataclass(frozen=True)
class Target:
    """A job and the checkpoint step whose weights stand in for its `model.path` (None: none)."""

    spec: Any                        # the resolved JobSpec
    checkpoint: Optional[Path]       # a complete step_* directory, or None
    step: int                        # the checkpoint's step (0: the job's initial model)

    @property
    def label(self) -> str:
        return f"checkpoint {self.checkpoint} (step {self.step})" if self.checkpoint else \
            f"model.path {self.spec.model.path} (no checkpoint)"


def _step_dir(root: Path, step: Optional[int], command: str) -> Optional[Path]:
    """The step directory under the checkpoint root `root`: `step`'s, or the latest; None when
    the root holds no checkpoint and no step was asked for."""
    from mrl.checkpoint import store
    from mrl.merge.source import resolve_checkpoint

    if step is not None:
        found = root / store.step_name(step)
        if not (root.is_dir() and found.is_dir()):
            have = [str(store.step_of(p)) for p in store.checkpoints(root)] if root.is_dir() else []
            raise UserError(f"{command}: --step {step}: no checkpoint at {found} "
                            f"({'steps saved: ' + ', '.join(have) if have else 'no checkpoint saved there'})")
        return resolve_checkpoint(found)
    if not root.is_dir() or (store.latest(root) is None and store.pointed(root) is None):
        return None
    return resolve_checkpoint(root)


def _recorded_spec_file(step_dir: Path, command: str, into: Path) -> Path:
    """The spec the checkpoint at `step_dir` was trained with, written to a TOML file in `into`."""
    from mrl.checkpoint import trust

    trust.require(step_dir, command)
    spec_toml = (trust.read_common(step_dir).get("extra") or {}).get("spec_toml")
    if not isinstance(spec_toml, str) or not spec_toml.strip():
        raise UserError(f"{command}: checkpoint {step_dir} does not record its job spec; pass the job file instead")
    path = into / "recorded_spec.toml"
    path.write_text(spec_toml, encoding="utf-8")
    return path


def resolve(source: str, overrides: list[str], step: Optional[int], command: str) -> Target:
    """The `Target` of `mrl <command> source [key=value ...] [--step N]`."""
    from mrl.checkpoint import store
    from mrl.config.loader import load

    path = Path(source)
    if step is not None and step < 0:
        raise UserError(f"{command}: --step {step}: must be >= 0")
    if not path.exists():
        raise UserError(f"{command}: {source} does not exist (give a job file or a run directory)")
    if path.is_dir():
        root = path / "checkpoints" / "actor"
        if not root.is_dir():
            raise UserError(f"{command}: {source} is not a run directory (no checkpoints/actor in it)")
        step_dir = _step_dir(root, step, command)
        if step_dir is None:
            raise UserError(f"{command}: {root} holds no complete checkpoint")
        with tempfile.TemporaryDirectory() as tmp:   # the recorded spec's paths are absolute
            spec, _ = load(_recorded_spec_file(step_dir, command, Path(tmp)), overrides)
    else:
        spec, _ = load(path, overrides)
        step_dir = _step_dir(Path(spec.checkpoint.dir) / "actor", step, command)
    if hasattr(spec, "sft"):
        raise UserError(f"{command}: {source} is an SFT job; `mrl {command}` runs RL jobs (merge an SFT "
                        "checkpoint with `mrl merge` to use it)")
    return Target(spec=spec, checkpoint=step_dir, step=store.step_of(step_dir) or 0 if step_dir else 0)
