"""Before a checkpoint is loaded: is it for this job's model, and did the job's rewards change?

A checkpoint records the Hugging Face config of the model it was saved from (`extra["hf_config"]`)
and the hashes of the reward files that scored it (`extra["reward_files"]`). A resume (or a
`checkpoint.load_from`) compares them with the job before megatron reads a tensor:

- a different model (hidden size, layers, heads, vocabulary, tied vs untied embeddings, dense vs
  MoE, ...) is a `UserError` in one line naming each difference, instead of megatron's
  shape-mismatch traceback;
- a reward file whose bytes changed since the checkpoint is said in one warning line: the run
  resumes (a fix to a reward is legitimate), but its curve may jump there.
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from mrl.errors import UserError

log = logging.getLogger(__name__)

# The config entries that decide the shapes and kinds of the model's tensors.
SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "intermediate_size", "moe_intermediate_size", "vocab_size", "num_experts_per_tok")


def _experts(cfg: Mapping[str, Any]) -> Optional[int]:
    return cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or None


def model_differences(saved: Mapping[str, Any], job: Mapping[str, Any]) -> list[str]:
    """What differs between the model a checkpoint was saved from and the job's, in words."""
    out = []
    saved_tied, job_tied = bool(saved.get("tie_word_embeddings", False)), bool(job.get("tie_word_embeddings", False))
    if saved_tied != job_tied:
        words = {True: "tied", False: "untied"}
        out.append(f"embeddings {words[saved_tied]} (checkpoint) vs {words[job_tied]} (job)")
    se, je = _experts(saved), _experts(job)
    if bool(se) != bool(je):
        kind = lambda n: f"MoE ({n} experts)" if n else "dense"   # noqa: E731
        out.append(f"{kind(se)} (checkpoint) vs {kind(je)} (job)")
    elif se != je:
        out.append(f"experts {se} (checkpoint) vs {je} (job)")
    for key in SHAPE_KEYS:
        if key in saved and key in job and saved[key] != job[key]:
            out.append(f"{key} {saved[key]} (checkpoint) vs {job[key]} (job)")
    return out


def file_hash(path: str | Path) -> Optional[str]:
    """sha256 of a file's bytes (None when it cannot be read)."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def reward_file_hashes(refs: Iterable[str]) -> dict[str, str]:
    """`{path: sha256}` of the `.py` files the job's reward references name ('file.py:function')."""
    out = {}
    for ref in refs:
        target = str(ref).rsplit(":", 1)[0]
        if target.endswith(".py") and (digest := file_hash(target)) is not None:
            out[str(Path(target).resolve())] = digest
    return out


def recorded_extra(ckpt: Path) -> dict:
    """The `extra` a checkpoint recorded, from its `common.pt` read through the restricted reader
    (`mrl.checkpoint.trust.read_common`, `weights_only=True`). Call it on a checkpoint already
    verified against its manifest; an unreadable file gives `{}` (the load that follows says why)."""
    from mrl.checkpoint import trust
    from mrl.errors import UserError

    try:
        common = trust.read_common(ckpt)
    except UserError:
        return {}
    extra = common.get("extra")
    return dict(extra) if isinstance(extra, dict) else {}


def check_resume(ckpt: Path, extra: Mapping[str, Any], *, job_hf: Mapping[str, Any],
                 reward_files: Mapping[str, str], warn=None) -> None:
    """Raise `UserError` when `ckpt` (whose recorded `extra` is given) holds another model than
    the job's; warn (via `warn`, rank 0's) about each reward file changed since it was saved."""
    saved_hf = extra.get("hf_config")
    if isinstance(saved_hf, Mapping):
        diff = model_differences(saved_hf, job_hf)
        if diff:
            raise UserError(f"checkpoint {ckpt} holds another model than the job's: {'; '.join(diff)}; resume it with "
                            "the model it was saved from, or start fresh in another checkpoint.dir")
    saved_rewards = extra.get("reward_files")
    if isinstance(saved_rewards, Mapping) and warn is not None:
        changed = sorted(p for p, h in reward_files.items() if p in saved_rewards and saved_rewards[p] != h)
        if changed:
            warn(f"reward file(s) changed since checkpoint {ckpt.name} was saved: {', '.join(changed)}; "
                 "scores from here on may not compare with the earlier steps")


def job_reward_files(reward_cfg) -> dict[str, str]:
    """The hashes of the job's reward function files (`reward_file_hashes`)."""
    from mrl.reward.sources import reward_sources

    try:
        sources = reward_sources(reward_cfg)
    except UserError:
        return {}
    return reward_file_hashes(s.ref for s in sources if s.kind == "function")


def before_load(ckpt: Path, job_hf: Mapping[str, Any], reward_cfg=None) -> None:
    """`check_resume` for the checkpoint about to be loaded, warnings on global rank 0."""
    import torch.distributed as dist

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    check_resume(ckpt, recorded_extra(ckpt), job_hf=job_hf,
                 reward_files=job_reward_files(reward_cfg) if reward_cfg is not None else {},
                 warn=log.warning if rank0 else None)
