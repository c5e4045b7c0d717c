"""mrl.checkpoint: atomic, resumable megatron distributed checkpoints (`save`, `load`) and their
directory bookkeeping (`store`)."""
from mrl.checkpoint.state import Loaded, load, resolve, save

__all__ = ["save", "load", "resolve", "Loaded"]
