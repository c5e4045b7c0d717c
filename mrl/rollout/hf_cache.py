"""The hf engine's decoding KV cache: the prefill's cache moved into buffers allocated once.

transformers' `DynamicCache` appends each decoded token by concatenating every layer's keys and
values with it, so decoding T tokens copies the whole cache T times (with 8 responses per prompt
at the SmolLM2 job's shape, about 300 MB per step). `in_place_from_prefill` gives each layer
buffers for the prompt width plus `max_tokens`, allocated once, and writes each new token into
them (`InPlaceLayer`); attention still reads only the positions written so far (a view of the
buffer), so each row computes what it did with the dynamic cache and nothing is read for tokens
not generated yet (transformers' `StaticCache` would attend over the whole allocation at every
step, which costs more than it saves when `max_tokens` is long and responses stop early).

It also takes the rows each response reads (the shared prefill's expansion, replacing
`reorder_cache`). Only caches whose every layer is plain full attention (`DynamicLayer`) are
moved; sliding-window, linear or indexed layers keep the dynamic cache (None is returned).
"""
from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import DynamicLayer


class InPlaceLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of buffers of `capacity` positions:
    `update` writes the new positions in place and widens the views."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int):
        super().__init__()
        width = keys.shape[-2]
        self._keys = keys.new_empty(*keys.shape[:-2], capacity, keys.shape[-1])
        self._values = values.new_empty(*values.shape[:-2], capacity, values.shape[-1])
        self._keys[..., :width, :] = keys
        self._values[..., :width, :] = values
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._length = width
        self.keys, self.values = self._keys[..., :width, :], self._values[..., :width, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self._length + key_states.shape[-2]
        if end > self._keys.shape[-2]:
            raise RuntimeError(f"hf engine: KV cache of {self._keys.shape[-2]} positions cannot take position {end}")
        self._keys[..., self._length:end, :] = key_states
        self._values[..., self._length:end, :] = value_states
        self._length = end
        self.keys, self.values = self._keys[..., :end, :], self._values[..., :end, :]
        return self.keys, self.values

    @property
    def capacity(self) -> int:
        return self._keys.shape[-2]


def in_place_from_prefill(cache, rows: Optional[torch.Tensor], capacity: int):
    """`cache` (the prefill's `DynamicCache`) with every layer moved into an `InPlaceLayer` of
    `capacity` positions holding its batch rows `rows` in that order (None: all); None (and
    `cache` untouched) where a layer is not plain full attention."""
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer or not layer.is_initialized for layer in layers):
        return None
    for i, layer in enumerate(layers):
        keys, values = (layer.keys, layer.values) if rows is None else (layer.keys[rows], layer.values[rows])
        layers[i] = InPlaceLayer(keys, values, capacity)
    return cache
