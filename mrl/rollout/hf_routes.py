"""The experts a `transformers` MoE model routes each token to, as the `hf` engine generates.

`transformers` 5's MoE blocks (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3) call a router module
`mlp.gate` returning `(router_logits, top_k_weights, top_k_indices)`; a forward hook keeps the
indices of every call, so the routes are exactly the ones the engine's experts used (group-limited
and bias-corrected choices included), not a top-k recomputed from logits. Layers are the MoE
layers in model order (dense layers have no router), the order `mrl.engine.routing` counts them.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["RouteCapture", "routers_of", "moe_layer_indices", "from_all_layers"]

ROUTE_DTYPE = torch.int16   # = mrl.engine.routing.ROUTE_DTYPE (the engine package is not imported here)


def routers_of(model) -> list[torch.nn.Module]:
    """The router modules of a `transformers` MoE model, in layer order (empty for a dense one)."""
    return [m for m in model.modules() if type(m).__name__.endswith(("TopKRouter", "TopkRouter"))]


class RouteCapture:
    """Hooks on a model's routers: `take(batch, tokens)` returns the routes of the last forward
    call `[batch, tokens, moe_layers, top_k]` (top-k sorted ascending) and forgets them."""

    def __init__(self, model):
        self.routers = routers_of(model)
        self._calls: list[Optional[torch.Tensor]] = [None] * len(self.routers)
        self._handles = []

    def __bool__(self) -> bool:
        return bool(self.routers)

    def __enter__(self) -> "RouteCapture":
        for i, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._keeper(i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._calls = [None] * len(self.routers)

    def _keeper(self, i: int):
        def keep(module, args, output):
            self._calls[i] = output[2].detach()
        return keep

    def take(self, batch: int, tokens: int) -> torch.Tensor:
        if any(c is None for c in self._calls):
            raise RuntimeError("hf engine: a router did not run in the last forward call")
        routes = torch.stack([c.reshape(batch, tokens, -1) for c in self._calls], dim=2)
        self._calls = [None] * len(self.routers)
        return routes.sort(-1).values.to(ROUTE_DTYPE).cpu()


def moe_layer_indices(hf: dict) -> list[int]:
    """0-based indices of the layers with routed experts, by `transformers`' rule for each MoE
    architecture (Qwen-MoE: not in `mlp_only_layers` and every `decoder_sparse_step`-th; DeepSeek-V3, GLM-4.5:
    from `first_k_dense_replace` on, every `moe_layer_freq`-th; Mixtral: all)."""
    n, kind = int(hf["num_hidden_layers"]), hf.get("model_type")
    if kind in ("qwen3_moe", "qwen2_moe", "qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe"):   # (Qwen3-Next, Qwen3.5-MoE: Qwen2-MoE blocks)
        dense, step = set(hf.get("mlp_only_layers") or ()), int(hf.get("decoder_sparse_step") or 1)
        return [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    if kind in ("deepseek_v3", "glm4_moe"):
        first, freq = int(hf.get("first_k_dense_replace") or 0), int(hf.get("moe_layer_freq") or 1)
        return [i for i in range(n) if i >= first and i % freq == 0]
    return list(range(n))


def from_all_layers(rows, moe_layers: list[int], tokens: int) -> torch.Tensor:
    """Routes `[tokens, moe_layers, k]` (int16, top-k sorted) from an engine's per-token rows over
    *all* layers (`[rows, num_layers, k]`, e.g. vLLM's `CompletionOutput.routed_experts`, which
    covers every token it fed: prompt + response - 1); tokens past the rows are -1 (unknown)."""
    t = torch.as_tensor(rows).to(torch.int64)[:, moe_layers].sort(-1).values.to(ROUTE_DTYPE)
    if t.shape[0] > tokens:
        raise ValueError(f"routes for {t.shape[0]} tokens, the sequence has {tokens}")
    pad = torch.full((tokens - t.shape[0], *t.shape[1:]), -1, dtype=ROUTE_DTYPE)
    return torch.cat([t, pad])
