"""mrl.engine: megatron-core training engine (packed token-balanced micro-batches, pipeline
schedule, guarded optimizer steps, eval passes). See `engine.Engine`."""
from mrl.engine.engine import Engine, Totals
from mrl.engine.packing import MicroBatch, pack, plan

__all__ = ["Engine", "Totals", "MicroBatch", "pack", "plan"]
