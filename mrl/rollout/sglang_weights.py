"""Moving verified weight buckets into an SGLang server (the two transports of SGLang 0.5.23).

The weight channel (`mrl/rollout/weight_channel.py`) has already checked every tensor (version,
position, checksum) when it reaches the engine; this module only delivers it, whole (SGLang's
`load_weights` takes full Hugging Face tensors and shards and fuses them itself).

- `tensor` (colocated, same node): `POST /update_weights_from_tensor` with one payload per TP rank of
  the server, each the base64 of a `ForkingPickler` dump of `[(name, tensor), ...]`: what SGLang's own
  `Engine._serialize_tensors_per_rank` sends (`MultiprocessingSerializer.serialize`,
  `sglang/srt/utils/common.py`). Only handles cross: a CUDA tensor is a CUDA IPC handle (its device
  written as the GPU's UUID, which SGLang's `patch_torch._device_from_maybe_uuid` maps back, so the
  server's CUDA_VISIBLE_DEVICES may differ from ours); a CPU tensor is a shared-memory file
  (torch's `file_system` strategy: the `file_descriptor` one needs a multiprocessing authkey the
  server process does not share). The server unpickles with its `SafeUnpickler` allowlist, which
  holds every global these payloads use.
- `distributed` (separate rollout ranks): this process joins a process group with the server's TP
  workers (`POST /init_weights_update_group`; we are rank 0, worker `tp_rank` is `1 + tp_rank`) and,
  per bucket, posts `names`/`dtypes`/`shapes` to `/update_weights_from_distributed` while it
  broadcasts each tensor from rank 0 in that order (the server receives them in list order:
  `WeightUpdater.receive_weights_from_distributed`).
"""
from __future__ import annotations

import base64
import contextlib
import io
import threading
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from typing import Callable, Sequence

import torch

#: the argument of torch's CUDA tensor reduction that holds the device index (SGLang's
#: `patch_torch._REDUCE_TENSOR_ARG_DEVICE_INDEX`; stable across torch releases)
_CUDA_DEVICE_ARG = 6


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype as SGLang reads it back (`getattr(torch, name)`)."""
    return str(dtype).removeprefix("torch.")


def _reduce_tensor(tensor: torch.Tensor):
    from torch.multiprocessing import reductions

    fn, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda and isinstance(args[_CUDA_DEVICE_ARG], int):
        uuid = str(torch.cuda.get_device_properties(args[_CUDA_DEVICE_ARG]).uuid)
        args = (*args[:_CUDA_DEVICE_ARG], uuid, *args[_CUDA_DEVICE_ARG + 1:])
    return fn, args


class _Pickler(ForkingPickler):
    """ForkingPickler with CUDA devices named by UUID (what SGLang's patched reductions send)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dispatch_table[torch.Tensor] = _reduce_tensor
        self.dispatch_table[torch.nn.Parameter] = _reduce_tensor


@contextlib.contextmanager
def _file_system_sharing():
    """CPU storages shared as named shared-memory files while a payload is pickled."""
    import torch.multiprocessing as tmp

    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        tmp.set_sharing_strategy(before)


_sharing_lock = threading.Lock()


def serialize_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[str, list]:
    """One TP rank's `serialized_named_tensors` entry: base64 of the pickled `[(name, tensor)]` list,
    and the tensors it refers to (handles only: keep them alive until the server has loaded them)."""
    # a CPU tensor is copied first: sharing moves a storage into shared memory in place, and the
    # stream's tensors may be the trainer's own
    named = [(name, t.detach() if t.is_cuda else t.detach().clone()) for name, t in named]
    buf = io.BytesIO()
    with _sharing_lock, _file_system_sharing():
        _Pickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode("ascii"), named


def tensor_update_request(named: Sequence[tuple[str, torch.Tensor]], tp_size: int, *,
                          weight_version: str | None = None) -> tuple[dict, list]:
    """The `/update_weights_from_tensor` body (`io_struct.UpdateWeightsFromTensorReqInput`) for one
    bucket: the same payload for every TP rank (each rank unpickles its own copy and takes its
    shard in `load_weights`), no flush (one `/flush_cache` ends the sync); and the tensors the
    payload refers to, to keep alive until the server answers."""
    payload, held = serialize_named_tensors(named)
    body = {"serialized_named_tensors": [payload] * tp_size, "load_format": None, "flush_cache": False,
            "abort_all_requests": False}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body, held


def distributed_update_request(named: Sequence[tuple[str, torch.Tensor]], group_name: str, *,
                               weight_version: str | None = None) -> dict:
    """The `/update_weights_from_distributed` body (`io_struct.UpdateWeightsFromDistributedReqInput`):
    what the server allocates before it receives the broadcasts, in broadcast order."""
    body = {"names": [n for n, _ in named], "dtypes": [dtype_name(t.dtype) for _, t in named],
            "shapes": [list(t.shape) for _, t in named], "group_name": group_name, "flush_cache": False,
            "abort_all_requests": False}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


def join_update_group(master_address: str, master_port: int, world_size: int, group_name: str,
                      backend: str, timeout_s: float):
    """Our side (rank 0) of the group the server's workers join in `init_weights_update_group`.

    The store SGLang's `init_custom_process_group` (`sglang/srt/utils/common.py`) reaches through
    `rendezvous("tcp://master_address:master_port")`: a TCP store that rank 0 hosts (made directly,
    not through `rendezvous`, which under torchrun would look for the agent's store instead),
    prefixed by the group name; then a process group outside the default world whose group ranks
    are its global ranks."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=True, timeout=timeout,
                          multi_tenant=True, wait_for_workers=False)
    store = c10d.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(world_size, 0, [], c10d.Backend(backend), store, group_name=group_name,
                                           timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def broadcast_bucket(named: Sequence[tuple[str, torch.Tensor]], group) -> None:
    """Send one bucket's tensors from rank 0, in the order of its request's `names`."""
    import torch.distributed as dist

    for _, tensor in named:
        dist.broadcast(tensor.detach().contiguous(), src=0, group=group)


def destroy_update_group(group) -> None:
    import torch.distributed as dist

    dist.destroy_process_group(group)


def while_posting(post: Callable[[], object], work: Callable[[], None]):
    """Run `post` (a blocking HTTP call the server answers only after `work` is done on our side)
    in a thread while `work` runs here; returns what `post` returned, raises what either raised."""
    out: dict = {}

    def run():
        try:
            out["value"] = post()
        except BaseException as e:   # re-raised in the caller's thread
            out["error"] = e

    thread = threading.Thread(target=run, name="mrl-sglang-post", daemon=True)
    thread.start()
    try:
        work()
    finally:
        thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]
