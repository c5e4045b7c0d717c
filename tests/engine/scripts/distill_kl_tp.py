"""The full-vocabulary reverse KL over a vocabulary split in two (2 ranks, gloo) equals the whole
rows' KL: value on every rank, and each rank's gradient equals its half of the whole gradient.
The ranks come up and go down through the platform (`_common.up` / `down`) as every other engine
script's: a bare `init_process_group` / `destroy_process_group` once aborted rank 0 at exit in CI
("terminate called without an active exception", gloo's threads at interpreter shutdown)."""
import torch
import torch.distributed as dist

import _engine_common as E  # noqa: F401  (puts the platform helpers on the path)
from _engine_common import C

from mrl.engine.distill_kl import reverse_kl


def main():
    C.up()
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(3)
    s, t = torch.randn(6, 32, generator=g) * 2, torch.randn(6, 32, generator=g) * 2
    s[:, 30:] = float("-inf")   # the last columns are Megatron's vocabulary padding (on rank 1)
    t[:, 30:] = float("-inf")
    w = torch.randn(6, generator=g)
    whole = s.clone().requires_grad_(True)
    want = reverse_kl(whole, t, 0.8)
    (want * w).sum().backward()
    half = s[:, rank * 16:(rank + 1) * 16].clone().requires_grad_(True)
    got = reverse_kl(half, t[:, rank * 16:(rank + 1) * 16], 0.8, group=dist.group.WORLD)
    (got * w).sum().backward()
    C.report("distill_kl_tp2_value", C.check("kl", got, want, tol=1e-5))
    C.report("distill_kl_tp2_grad", C.check("grad", half.grad, whole.grad[:, rank * 16:(rank + 1) * 16], tol=1e-6))
    C.down()


if __name__ == "__main__":
    main()
