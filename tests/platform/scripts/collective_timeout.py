"""Rank 1 skips an all_reduce; rank 0 must get a CollectiveTimeout naming the stage within the
collective timeout (gloo enforces the process-group timeout; `stage` names it)."""
import sys
import time

import torch
import torch.distributed as dist

from mrl.errors import CollectiveTimeout
from mrl.platform import setup, stage, teardown
from mrl.platform.config import ParallelConfig, PlatformConfig

TIMEOUT = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0


def main():
    ctx = setup(PlatformConfig(device="cpu", ranks_per_node=2, collective_timeout_s=TIMEOUT), ParallelConfig(),
                seed=0)
    with stage("warm-up"):
        dist.all_reduce(torch.ones(1))  # both ranks: the group works
    if ctx.rank == 0:
        t0 = time.monotonic()
        try:
            with stage("weight sync"):
                dist.all_reduce(torch.ones(8))
        except CollectiveTimeout as e:
            elapsed = time.monotonic() - t0
            msg = str(e)
            assert "collective in stage 'weight sync' did not finish within" in msg, msg
            assert f"{TIMEOUT:g} s" in msg, msg
            assert elapsed < TIMEOUT + 5, f"took {elapsed:.1f} s for a {TIMEOUT} s timeout"
            print(f"TIMEOUT_OK {elapsed:.2f} {msg}", flush=True)
        else:
            raise AssertionError("all_reduce with a missing peer returned")
    else:
        time.sleep(TIMEOUT + 3)  # skip the collective; stay alive past the peer's timeout
    teardown()


if __name__ == "__main__":
    main()
