"""Check a merged directory: reload it with `transformers` and compare its outputs on a probe batch
with the Megatron model's.

Both sides compute in float32 (the Megatron model is loaded in float32 for verification; the
directory is reloaded with `dtype=float32`, which is exact for any stored dtype). The Megatron
weights are first rounded to the output dtype, so the check measures the conversion — names,
splits, transposes, vocabulary padding — not bf16 arithmetic. The tolerance is relative to the
size of the outputs: `max|diff| <= tol * max(1, max|reference|)`.

An LM is compared on logits (`AutoModelForCausalLM`); a critic or reward model on values: the
reloaded base model's last hidden state (`AutoModel`) times `score.weight` from
`value_head.safetensors`.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import torch

from mrl.merge.model import forward
from mrl.merge.source import CheckpointInfo

DEFAULT_TOLERANCE = 1e-4
VALUE_HEAD_FILE = "value_head.safetensors"
VALUE_HEAD_NAME = "score.weight"


@dataclasses.dataclass(frozen=True)
class Verification:
    what: str            # "logits" | "values"
    max_abs_diff: float
    scale: float         # max |reference output|
    tolerance: float     # relative tolerance
    tokens: int

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance * max(1.0, self.scale)


def probe_tokens(vocab_size: int, batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def round_to(model: torch.nn.Module, dtype: Optional[torch.dtype]) -> None:
    """Round the model's parameters, in place, to what `dtype` can hold (no-op for float32)."""
    if dtype is None or dtype == torch.float32:
        return
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype))


def verify(out_dir: Path, model: torch.nn.Module, info: CheckpointInfo, *, dtype: Optional[torch.dtype],
           tolerance: float = DEFAULT_TOLERANCE) -> Verification:
    """Compare `out_dir` (reloaded) with `model` (float32, the checkpoint's) on a probe batch;
    `dtype` is the dtype the weights were cast to (None: each kept its stored dtype)."""
    vocab = info.hf_config["vocab_size"]
    tokens = probe_tokens(vocab)
    round_to(model, dtype)
    megatron = forward(model, tokens).float()
    if info.valued:
        want = megatron.squeeze(-1)
        got = _hf_values(out_dir, tokens)
    else:
        from mrl.models.vlm import open_columns

        want = megatron[..., :vocab]
        got = _hf_logits(out_dir, tokens)
        keep = open_columns(info.hf_config)
        if keep is not None:   # a VLM's policy bans its vision placeholders; the checkpoint's logits do not
            want, got = want[..., keep], got[..., keep]
    diff = (got.double() - want.double()).abs().max().item()
    return Verification(what="values" if info.valued else "logits", max_abs_diff=diff,
                        scale=want.abs().max().item(), tolerance=tolerance, tokens=tokens.numel())


def _reload(cls, out_dir: Path):
    """`cls.from_pretrained(out_dir)` in float32, without transformers' progress bar."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return cls.from_pretrained(out_dir, dtype=torch.float32).eval()
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _hf_logits(out_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    vision = getattr(AutoConfig.from_pretrained(out_dir), "vision_config", None) is not None
    hf = _reload(AutoModelForImageTextToText if vision else AutoModelForCausalLM, out_dir)
    with torch.no_grad():
        return hf(tokens).logits.float()


def _hf_values(out_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    from safetensors.torch import load_file
    from transformers import AutoModel

    hf = _reload(AutoModel, out_dir)
    head = load_file(str(out_dir / VALUE_HEAD_FILE))[VALUE_HEAD_NAME].float()
    with torch.no_grad():
        hidden = hf(tokens).last_hidden_state.float()
    return (hidden @ head.T).squeeze(-1)
