"""Megatron writes a torch_dist checkpoint (one process, gloo) with tensors in `DTYPE`, a
`ShardedObject` (a bytes entry) and the optimizer's content metadata, exactly as
`mrl.checkpoint.state.save` does; `trust.read_dcp_metadata` must return what plain pickle
returns. Usage: real_metadata.py DIR float32|bfloat16 PORT. Prints "same" when it is."""
import os
import pickle
import sys
from pathlib import Path

import torch


def main(out: str, dtype: str, port: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    from mrl.checkpoint import trust
    from mrl.checkpoint.state import OPTIM_METADATA, _strategies
    from mrl.platform import cpu_compat

    cpu_compat.activate()
    dt = getattr(torch, dtype)
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(12, dtype=dt).reshape(4, 3)),
             "b": ShardedTensor.from_rank_offsets("b", torch.ones(5, dtype=dt)),
             "obj": ShardedObject("obj", {"cursor": 3}, (1,), (0,)), "step": 3}
    os.makedirs(out, exist_ok=True)
    dist_checkpointing.save(state, out, sharded_strategy=_strategies(Path(out), loading=False),
                            content_metadata=OPTIM_METADATA)
    got = trust.read_dcp_metadata(out)
    with open(Path(out) / ".metadata", "rb") as f:
        want = pickle.load(f)   # noqa: S301 - the test's own file, compared with the restricted read
    assert got == want and got.all_local_plans == want.all_local_plans, (got, want)
    shapes = trust.tensor_shapes(out)
    assert shapes == {"w": trust.TensorShape((4, 3), dt), "b": trust.TensorShape((5,), dt)}, shapes
    torch.distributed.destroy_process_group()
    print("same")


if __name__ == "__main__":
    main(*sys.argv[1:4])
