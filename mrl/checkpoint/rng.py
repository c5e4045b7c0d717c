"""A rank's RNG streams in a checkpoint (python, numpy, torch, cuda, megatron's tracker), as
tensors and plain numbers only: `rng_state` captures them, `read_rng_file` reads a saved file with
`weights_only=True` (any other pickled object is refused, never executed), `set_rng_state`
restores them. `state.py` saves one file per rank and restores it only on the layout that saved it.
"""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from mrl.errors import UserError


def rng_state() -> dict:
    """This rank's RNG streams as tensors and plain numbers only (no pickled objects), so a
    checkpoint's RNG file loads with `torch.load(weights_only=True)` and cannot run code."""
    from megatron.core import tensor_parallel

    version, words, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": {"version": int(version), "state": torch.tensor(words, dtype=torch.int64),
                        "gauss": None if gauss is None else float(gauss)},
             "numpy": {"keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
             "torch": torch.get_rng_state(),
             "tracker": {str(k): v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    py = state["python"]
    random.setstate((py["version"], tuple(int(w) for w in py["state"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def read_rng_file(path: Path, ckpt: Path) -> dict:
    """An RNG file, read as plain tensors and numbers (`weights_only=True`): a file holding any
    other pickled object is refused, never executed."""
    import pickle

    try:
        saved = torch.load(path, weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"checkpoint {ckpt}: {path.relative_to(ckpt)} is not plain tensor data and was not loaded "
                        f"(only tensors and numbers are read from checkpoints): {first[:200]}") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("rng"), dict) or not isinstance(saved.get("layout"), dict):
        raise UserError(f"checkpoint {ckpt}: {path.relative_to(ckpt)} is not an mrl RNG state file")
    return saved
