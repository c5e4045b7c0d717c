"""Rebuild a checkpoint's model in this one process (TP = PP = EP = 1 on cpu) and load its weights.

`dist_checkpointing` reshards on load, so a checkpoint saved at any TP/PP/EP layout loads into
the single-rank model; only the model's tensors are read (no optimizer state, no RNG).
The vocabulary is padded exactly as in the checkpoint (the saving TP size decided the padding).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from mrl.errors import UserError
from mrl.merge.source import CheckpointInfo

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@contextmanager
def single_process_platform(seed: int = 0) -> Iterator[None]:
    """megatron's parallel state for one cpu rank, whatever launcher variables the shell has
    (`seed`: a LoRA checkpoint over a builtin preset rebuilds the preset's seeded init)."""
    from mrl import platform
    from mrl.platform.config import ParallelConfig, PlatformConfig

    platform.setup(PlatformConfig(device="cpu", ranks_per_node=1), ParallelConfig(distributed_optimizer=False),
                   seed=seed, env={})
    try:
        yield
    finally:
        platform.teardown()


def load_model(info: CheckpointInfo, dtype: torch.dtype) -> torch.nn.Module:
    """The checkpoint's model with its weights, parameters in `dtype` (needs the platform up)."""
    from mrl.checkpoint import state
    from mrl.models.roles import build_role_model
    from mrl.platform.config import ParallelConfig

    role = "critic" if info.valued else "actor"
    model = build_role_model(role, info.hf_config, ParallelConfig(distributed_optimizer=False),
                             dtype=_DTYPE_NAMES[dtype], device="cpu", vocab_multiple=info.padded_vocab)
    if info.lora:   # adapters-only checkpoint: the base from model.path, then the adapters on it
        from mrl.models.facts import builtin_preset
        from mrl.models.lora import LoraConfig, adapters_only_checkpoints, apply_lora
        from mrl.weights import load_hf_checkpoint

        if builtin_preset(info.model_path) is None:
            from pathlib import Path

            if not (Path(info.model_path) / "config.json").is_file():
                raise UserError(f"merge: the LoRA checkpoint's base model {info.model_path!r} is not a local "
                                "Hugging Face directory here; pass --model with it")
            load_hf_checkpoint([model], info.model_path, info.hf_config, role="actor")
        lora = info.lora
        cfg = LoraConfig(rank=int(lora["rank"]), alpha=float(lora["alpha"]),
                         target_modules=tuple(lora["target_modules"]))
        model = adapters_only_checkpoints(apply_lora(model, cfg, seed=info.seed))
    try:
        state.load(info.path, chunks=[model], load_rng=False)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - megatron's shape/key errors: the config does not fit
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UserError(f"merge: checkpoint {info.path} does not match its model config "
                        f"({type(e).__name__}: {first[:300]})") from None
    return model.eval()


def forward(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Logits `[B, S, V_pad]` (or values `[B, S, 1]` for a value head) of the single-rank model."""
    from mrl.models.megatron import position_ids

    b, s = tokens.shape
    with torch.no_grad():
        return model(tokens, position_ids(b, s), None)


def stored_dtypes(model: torch.nn.Module, info: CheckpointInfo) -> dict[str, torch.dtype]:
    """Megatron parameter name -> the dtype the checkpoint stores it in (through the model's own
    sharded state dict, which names each parameter's checkpoint key)."""
    out = {}
    for name, entry in model.sharded_state_dict().items():
        key = getattr(entry, "key", None)
        if key in info.tensor_dtypes:
            out[name] = info.tensor_dtypes[key]
    return out
