"""`mrl merge`: a Megatron distributed checkpoint (any TP/PP/EP) -> a Hugging Face directory.

    from mrl.merge import merge
    report = merge("runs/x/checkpoints/actor", "out/x-hf", max_shard_size="2GB")

See `tools/checkpoint_merge/README.md` for the output layout and the critic's value head.
Heavy imports (torch, megatron, transformers) happen only when `merge` runs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mrl.merge.convert import MergeReport, merge

__all__ = ["merge", "MergeReport"]


def __getattr__(name: str):
    if name in __all__:
        from mrl.merge import convert

        return getattr(convert, name)
    raise AttributeError(f"module 'mrl.merge' has no attribute {name!r}")
