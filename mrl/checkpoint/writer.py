"""megatron's torch_dist save strategy, its files written by threads of the saving process.

megatron-core 0.16.1's torch_dist writer (`FileSystemWriterAsync`) forks one process per output
file at every save and collects their results through a `multiprocessing` manager process (a
process of its own, started at the first save, that outlived a trainer killed outright). A
synchronous save gains nothing from either: the bytes are the same, and the writes release the
GIL. `save_strategy()` is that strategy with its write step replaced by a thread per file of this
process, each running megatron's own `write_preloaded_data` on its bucket (same files, same
`.metadata`, same fsyncs), its results handed back through in-process queues.
"""
from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor
from functools import partial

__all__ = ["save_strategy"]


def _write_buckets(transforms: list, rank: int, buckets: list, results: queue.Queue) -> None:
    """Write each bucket (one output file; its tensors already in host memory: megatron's preload
    step) on a thread; put {bucket index: write results} (or the first exception) into `results`,
    as megatron's forked writers do. `rank` is unused (the forked writers' signature)."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    local, count = queue.Queue(), queue.Queue()
    for i in range(len(buckets)):
        count.put(i)

    def one(i_bucket):
        i, bucket = i_bucket
        FileSystemWriterAsync.write_preloaded_data(transforms, i, bucket, local, count, True)

    with ThreadPoolExecutor(max_workers=len(buckets), thread_name_prefix="mrl-ckpt-write") as pool:
        list(pool.map(one, enumerate(buckets)))
    out = {}
    for _ in buckets:
        i, got = local.get_nowait()
        if isinstance(got, Exception):
            results.put(got)
            return
        out[i] = got
    results.put(out)


def save_strategy():
    """megatron's `TorchDistSaveShardedStrategy` ('torch_dist', version 1), writing in threads."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    if filesystem_async._results_queue is None:
        # `prepare_write_data` asks for the module's results queue (starting a manager process
        # when there is none); the threads below report through their own queue instead
        filesystem_async._results_queue = queue.Queue()

    class ThreadedTorchDistSave(TorchDistSaveShardedStrategy):
        def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret):
            request = super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret)
            if not writer.write_buckets:
                return request
            writer.results_queue = queue.Queue()
            transforms = [writer.transforms] if hasattr(writer, "transforms") else []
            return request._replace(async_fn=partial(_write_buckets, transforms),
                                    async_fn_args=(request.async_fn_args[0], writer.write_buckets, writer.results_queue))

    return ThreadedTorchDistSave("torch_dist", 1)
