"""Shared helpers for the platform's multi-process test scripts (run under torchrun, gloo)."""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from mrl.platform import setup, teardown
from mrl.platform.config import ParallelConfig, PlatformConfig

TOL = 1e-5


def up(seed: int = 1234, **parallel) -> "object":
    """Bring the 2-rank cpu platform up with the given `parallel.*` sizes."""
    return setup(PlatformConfig(device="cpu", nodes=1, ranks_per_node=2, collective_timeout_s=120),
                 ParallelConfig(**parallel), seed=seed)


def down() -> None:
    teardown()


def report(name: str, value: float) -> float:
    """Max of `value` over ranks (a collective: every rank must call it), printed by rank 0 as a
    `MAXDIFF` line that the pytest side collects."""
    v = torch.tensor(float(value), dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"MAXDIFF {name} {v.item():.3e}", flush=True)
    return v.item()


def check(name: str, a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> float:
    """Assert two tensors agree within `tol` on this rank; returns the max abs difference (local)."""
    assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    d = (a.detach().double() - b.detach().double()).abs().max().item() if a.numel() else 0.0
    assert d <= tol, f"{name}: max abs diff {d:.3e} > {tol:g}"
    return d


def perturb_(model: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    """Add seeded noise to every parameter (norm weights included) so no test passes on init symmetry."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=g) * scale)


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.grad.detach().clone() for k, v in model.named_parameters() if v.grad is not None}


# ---- megatron TP/EP shard layout of the tiny GPT (local spec, SwiGLU, GQA) ----

def shard(name: str, full: torch.Tensor, tp: int, tp_rank: int, *, num_query_groups: int) -> torch.Tensor:
    """The TP shard of a full (TP=1) parameter, following megatron's layouts.

    - linear_qkv.weight [(nq + 2*ng) * d, H]: rows grouped by query group g as
      [q heads of g | k_g | v_g]; TP rank r owns query groups r*ng/tp .. (r+1)*ng/tp - 1.
    - linear_fc1.weight with SwiGLU [2F, H] = [gate; up]; TP rank r owns [gate_r; up_r], not a
      contiguous row block of the full matrix.
    - column parallel (embedding, output layer): rows split; row parallel (linear_proj,
      linear_fc2): columns split; norms and the router: replicated.
    """
    if tp == 1:
        return full
    if name.endswith("linear_qkv.weight"):
        per_group = full.view(num_query_groups, -1, full.shape[-1])
        return per_group.chunk(tp, dim=0)[tp_rank].reshape(-1, full.shape[-1])
    if name.endswith("linear_fc1.weight"):
        gate, up_ = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up_.chunk(tp, dim=0)[tp_rank]], dim=0)
    if name.endswith(("word_embeddings.weight", "output_layer.weight")):
        return full.chunk(tp, dim=0)[tp_rank]
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return full.chunk(tp, dim=1)[tp_rank]
    if name.endswith(("layernorm.weight", "final_layernorm.weight", "router.weight", "norm.weight")):
        return full
    raise KeyError(f"no TP layout rule for {name}")


def main_guard(fn) -> None:
    try:
        fn()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        raise
