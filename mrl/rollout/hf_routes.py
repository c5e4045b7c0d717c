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

__all__ = ["RouteCapture", "routers_of"]

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
