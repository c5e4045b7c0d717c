"""The hf engine's decoding KV cache: the prefill's cache moved into one allocated once.

transformers' `DynamicCache` appends each decoded token by concatenating every layer's keys and
values with it, so decoding T tokens copies the whole cache T times (with 8 responses per prompt
at the SmolLM2 job's shape, about 300 MB per step). A `StaticCache` allocates the prompt width plus
`max_tokens` once and writes each new token in place; attention reads the allocated length under
the padding mask (the columns not yet written are masked out, so each row computes what it did).

`static_from_prefill` builds one from the prefill's cache, taking the rows each response reads
(the shared prefill's expansion, which replaces `reorder_cache`). Only caches whose every layer
is plain full attention are moved (`DynamicLayer` into `StaticLayer`); sliding-window, linear or
indexed layers keep the dynamic cache (None is returned).
"""
from __future__ import annotations

from typing import Optional

import torch


def static_from_prefill(model: torch.nn.Module, cache, rows: Optional[torch.Tensor], max_len: int):
    """A `StaticCache` of `max_len` positions holding `cache`'s prefill (its batch rows `rows`, in
    that order; None: all), or None where a layer is not plain full attention."""
    from transformers.cache_utils import DynamicLayer, StaticCache, StaticLayer

    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer or not layer.is_initialized for layer in layers):
        return None
    static = StaticCache(config=model.config, max_cache_len=max_len)
    if len(static.layers) != len(layers) or any(type(layer) is not StaticLayer for layer in static.layers):
        return None
    for src, dst in zip(layers, static.layers):
        keys, values = (src.keys, src.values) if rows is None else (src.keys[rows], src.values[rows])
        dst.lazy_initialization(keys, values)
        dst.update(keys, values)   # written at positions 0 .. width-1; the length counter follows
    return static
