"""A checkpoint save that runs out of disk on 2 ranks (usage: ckpt_enospc.py FULL_DIR, a small
tmpfs): every rank gets one `UserError` line saying "No space left on device", and the partial
save is removed. Prints `FAULT disk_full_mid_save handled|lost <line>` on rank 0."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "engine" / "scripts"))
import _engine_common as E  # noqa: E402
from _engine_common import C  # noqa: E402

from mrl import checkpoint  # noqa: E402
from mrl.errors import UserError  # noqa: E402


def main(full: str):
    C.up(tensor=2)
    eng = E.actor_engine(None, distributed=False)
    root = Path(full) / "ckpt"
    try:
        checkpoint.save(root, 1, chunks=eng.chunks, optimizer=eng.optimizer, scheduler=eng.scheduler)
        ok, line = False, "saved"
    except UserError as e:
        line = str(e)
        ok = "No space left on device" in line and "\n" not in line and not list(root.glob(".tmp.*"))
    flag = torch.tensor([float(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if dist.get_rank() == 0:
        print(f"FAULT disk_full_mid_save {'handled' if flag.item() == 1.0 else 'lost'} {line}", flush=True)
    C.down()


if __name__ == "__main__":
    C.main_guard(lambda: main(sys.argv[1]))
