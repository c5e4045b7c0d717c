"""Find and describe the checkpoint to merge, without building a model.

A checkpoint is given as a root (`<run>/checkpoints/actor`, resolved through its `latest`
pointer) or as one `step_XXXXXXXX` directory. Everything `mrl merge` needs to rebuild the model
comes from the checkpoint's common state (`extra`, written by the training loop) and from the
torch_dist tensor metadata (global shapes and dtypes), so a malformed or partial checkpoint is
reported in one line before any model is built. The checkpoint is checked against its manifest
and both pickled files are read by `mrl.checkpoint.trust`'s restricted readers first: a crafted
checkpoint runs no code.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

import torch

from mrl.checkpoint import store, trust
from mrl.errors import UserError

# Files every complete torch_dist checkpoint written by `mrl.checkpoint.state.save` has.
REQUIRED_FILES = ("metadata.json", "common.pt", ".metadata")
EMBEDDING_KEY = "embedding.word_embeddings.weight"
VALUED_ROLES = ("critic", "reward")


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What a merge needs to know about one checkpoint directory."""

    path: Path
    step: int
    role: str                      # actor | critic | ref | reward
    hf_config: dict[str, Any]      # complete HF config (transformers' defaults filled in)
    model_path: Optional[str]      # the job's model.path (tokenizer/generation config source)
    tokenizer: Optional[str]       # the job's model.tokenizer
    stored_dtype: torch.dtype      # dtype of the saved model tensors
    padded_vocab: int              # embedding rows as saved (vocabulary padded for TP)
    num_params: int                # model parameters as saved (padding included)
    layout: dict[str, Any]         # the parallel layout that saved it
    tensor_dtypes: dict[str, torch.dtype] = dataclasses.field(default_factory=dict, repr=False)
    # ^ ShardedTensor key -> stored dtype (norms may be float32 in a bf16 model)
    lora: dict[str, Any] = dataclasses.field(default_factory=dict)
    # ^ a LoRA checkpoint's adapter settings (rank, alpha, target_modules): it holds adapters only,
    #   the base comes from model_path
    seed: int = 0                  # the job's seed: a builtin preset's base is megatron's seeded init

    @property
    def valued(self) -> bool:
        """True for models whose head is a value head (`score.weight`) instead of an LM head."""
        return self.role in VALUED_ROLES


def resolve_checkpoint(path: str | Path) -> Path:
    """The step directory to merge; a one-line `UserError` for anything that is not a complete
    checkpoint (missing path, unfinished `.tmp.*` save, a root with nothing committed, missing files)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"merge: {path} does not exist")
    if not path.is_dir():
        raise UserError(f"merge: {path} is not a checkpoint directory (it is a file)")
    if path.name.startswith(".tmp."):
        raise UserError(f"merge: {path} is an unfinished save (a .tmp.* directory); "
                        "pass the checkpoint root or a complete step_* directory")
    if store.step_of(path) is None and not (path / "metadata.json").is_file():
        pointer = path / store.LATEST
        target = store.pointed(path)   # a pointer out of the root is refused there
        if target is not None:
            if not target.is_dir():
                raise UserError(f"merge: {pointer} names {target.name!r}, which is not a "
                                "checkpoint directory here")
            path = target
        else:
            found = store.latest(path)
            if found is None:
                partial = sorted(p.name for p in path.iterdir() if p.name.startswith(".tmp.step_"))
                if partial:
                    raise UserError(f"merge: {path} has no complete checkpoint (no `latest`, only the "
                                    f"unfinished save {partial[-1]})")
                raise UserError(f"merge: {path} is not a checkpoint (no `latest`, no step_* directory, "
                                "no metadata.json)")
            path = found
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        raise UserError(f"merge: checkpoint {path} is incomplete: {missing[0]} is missing")
    try:
        config = json.loads((path / "metadata.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"merge: checkpoint {path}: metadata.json is unreadable ({e})") from None
    if config.get("sharded_backend") != "torch_dist":
        raise UserError(f"merge: checkpoint {path} uses backend {config.get('sharded_backend')!r}; "
                        "only torch_dist checkpoints (what mrl saves) are supported")
    return path


def _model_tensors(path: Path) -> dict[str, trust.TensorShape]:
    """ShardedTensor key -> global shape and dtype of the model's tensors, from `.metadata` read
    by the restricted unpickler (never by torch's reader: that is a plain `pickle.load`)."""
    return {k: v for k, v in trust.tensor_shapes(path).items() if not k.startswith("optimizer.")}


def inspect(path: str | Path, *, model: Optional[str] = None) -> CheckpointInfo:
    """Describe the checkpoint at `path` (a root or a step directory).

    `model` (an HF directory, a cached Hub id or `builtin:<preset>`) supplies the architecture for
    checkpoints that do not record it; it overrides the recorded one when given.
    """
    from mrl.models.megatron import complete_hf_config, hf_config as model_hf_config
    from mrl.models.config import ModelConfig

    step_dir = resolve_checkpoint(path)
    trust.require(step_dir, "merge")     # its bytes are the ones saved, before any of them is unpickled
    common = trust.read_common(step_dir)
    tensors = _model_tensors(step_dir)
    extra = dict(common.get("extra") or {})
    if model is not None:
        hf = model_hf_config(ModelConfig(path=model))
        model_path = model
    elif extra.get("hf_config"):
        hf = complete_hf_config(dict(extra["hf_config"]))
        model_path = extra.get("model_path")
    else:
        raise UserError(f"merge: checkpoint {step_dir} does not record its model (no hf_config in its state); "
                        "pass --model with the job's model.path")
    lora, seed = _lora_of(extra)
    layout = dict(common.get("layout") or {})
    role = extra.get("role") or ("critic" if _has_value_head(tensors) else "actor")
    common_fields = dict(path=step_dir, step=int(common.get("step", store.step_of(step_dir) or 0)), role=role,
                         hf_config=hf, model_path=model_path, tokenizer=extra.get("tokenizer"), layout=layout,
                         tensor_dtypes={k: t.dtype for k, t in tensors.items()})
    if lora:
        from mrl.models.megatron import padded_vocab_size

        if not tensors or not all(".lora." in k for k in tensors):
            raise UserError(f"merge: checkpoint {step_dir} records LoRA settings but does not hold adapters only")
        if model_path is None:
            raise UserError(f"merge: LoRA checkpoint {step_dir} does not record its base model; pass --model")
        padded = padded_vocab_size(hf["vocab_size"], int(layout.get("tp", 1)))
        h, ffn = hf["hidden_size"], hf["intermediate_size"]
        approx = padded * h + hf["num_hidden_layers"] * (4 * h * h + 3 * h * ffn)   # the base, for --verify's default
        return CheckpointInfo(**common_fields, stored_dtype=next(iter(tensors.values())).dtype, padded_vocab=padded,
                              num_params=approx, lora=lora, seed=seed)
    if EMBEDDING_KEY not in tensors:
        raise UserError(f"merge: checkpoint {step_dir} holds no model weights ({EMBEDDING_KEY} is missing)")
    emb = tensors[EMBEDDING_KEY]
    return CheckpointInfo(
        **common_fields, stored_dtype=emb.dtype, padded_vocab=int(emb.global_shape[0]),
        num_params=sum(int(torch.Size(t.global_shape).numel()) for t in tensors.values()))


def _lora_of(extra: dict) -> tuple[dict, int]:
    """(the adapter settings of a LoRA checkpoint or {}, the job's seed) from its recorded spec:
    `sft.lora` / `actor.lora` with rank > 0."""
    import tomllib

    try:
        spec = tomllib.loads(extra.get("spec_toml") or "")
    except tomllib.TOMLDecodeError:
        spec = {}
    seed = int(spec.get("job", {}).get("seed", 0))
    lora = extra.get("lora") or spec.get("sft", {}).get("lora") or spec.get("actor", {}).get("lora") or {}
    return (dict(lora) if lora.get("rank") else {}), seed


def _has_value_head(tensors: dict) -> bool:
    head = tensors.get("output_layer.weight")
    return head is not None and int(head.global_shape[0]) == 1
