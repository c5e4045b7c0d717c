"""mrl.checkpoint: atomic, resumable megatron distributed checkpoints (`save`, `load`) and their
directory bookkeeping (`store`)."""
from mrl.checkpoint.state import Loaded, find_resumable, load, resolve, save, verify

__all__ = ["save", "load", "resolve", "verify", "find_resumable", "Loaded"]
