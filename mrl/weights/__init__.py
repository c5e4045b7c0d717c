"""The weight-mapping layer: Megatron TP/PP/EP shards <-> Hugging Face-named tensors.

- `load_hf_checkpoint(chunks, path, hf_config)`: HF safetensors -> this rank's shards.
- `Exporter(chunks, hf_config).stream(targets)`: full HF tensors, streamed; `hf_buckets` packs them.
- `tables.TABLES`: one declarative table per architecture.
"""
from __future__ import annotations

from mrl.weights.hf_export import Exporter, export_hf_weights, hf_buckets
from mrl.weights.hf_import import Checkpoint, ImportReport, load_hf_checkpoint
from mrl.weights.tables import TABLES, table_for

__all__ = ["Exporter", "export_hf_weights", "hf_buckets", "Checkpoint", "ImportReport", "load_hf_checkpoint",
           "TABLES", "table_for"]
