"""MoE routes: which experts each token goes to, laid out with the tokens, replayed and observed.

Routes are integer tensors `[tokens, moe_layers, top_k]` of expert indices; the MoE layers are
counted in model order over the whole model (the `moe_layer_numbers` of its config), whatever
pipeline stage holds them. -1 marks a token whose routes are unknown (padding): the router then
keeps its own choice for that token.

Layouts follow the `Batch` (`mrl/batch.py`): `*_prompt_routes [B, P, L, k]` are left-padded
like `prompt_ids`, `*_response_routes [B, R, L, k]` right-padded like `response_ids`. Two sources
use those names: `rollout_*` (what the rollout engine routed to; routing replay R3) and
`trainer_*` (what the trainer's old-log-prob pass routed to; R2). `pack_row` lays a micro-batch's
routes out along its packed row exactly as `mrl.engine.packing.pack` lays out the tokens, and
`unpack_row` is its inverse, so routes follow the tokens through mini-batches, the micro-batch
split and packing.

`RouterHooks` builds on megatron-core's replay (`megatron.core.transformer.moe.router_replay`:
the router asks its `RouterReplay` for the top-k, and a replayed top-k gathers the router's own
scores at the given experts). Each router of a model gets an `ObservingReplay`, which always
computes the router's own top-k (kept for the agreement metric and R2's record) and returns the
target routes when a pass replays. With sequence parallelism a router sees this TP rank's slice
of the row (`sp_slice`); with pipeline parallelism a stage's routers are its own layers.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

__all__ = ["moe_layer_numbers", "pack_row", "unpack_row", "sp_slice", "same_experts", "load_ratio",
           "ObservingReplay", "RouterHooks", "ROUTE_DTYPE"]

ROUTE_DTYPE = torch.int16   # expert indices (up to 32767 experts), -1 = unknown


def moe_layer_numbers(num_layers: int, moe_layer_freq) -> list[int]:
    """The 1-based numbers of the layers with routed experts, from megatron's `num_layers` and
    `moe_layer_freq` (an int: every n-th layer from the first; or a 0/1 list per layer)."""
    if isinstance(moe_layer_freq, int):
        return [i + 1 for i in range(num_layers) if i % moe_layer_freq == 0]
    pattern = list(moe_layer_freq)
    if len(pattern) != num_layers:
        raise ValueError(f"moe_layer_freq has {len(pattern)} entries for {num_layers} layers")
    return [i + 1 for i, x in enumerate(pattern) if x]


# ---------------------------------------------------------------------------- layouts (pure)

def pack_row(prompt_routes: torch.Tensor, response_routes: torch.Tensor, prompt_lengths: Sequence[int],
             response_lengths: Sequence[int], row_tokens: int) -> torch.Tensor:
    """The routes of one packed row `[row_tokens, L, k]`: each sequence's real prompt tokens (the
    last `p` of its left-padded prompt row), then its first `r` response tokens, sequence after
    sequence; -1 for the row's padding. The same order as `packing.pack` lays out token ids."""
    L, k = prompt_routes.shape[2], prompt_routes.shape[3]
    P = prompt_routes.shape[1]
    pieces = []
    for i, (p, r) in enumerate(zip(prompt_lengths, response_lengths)):
        pieces.append(prompt_routes[i, P - p:])
        pieces.append(response_routes[i, :r])
    used = sum(int(p) + int(r) for p, r in zip(prompt_lengths, response_lengths))
    if used > row_tokens:
        raise ValueError(f"{used} tokens do not fit a row of {row_tokens}")
    pieces.append(torch.full((row_tokens - used, L, k), -1, dtype=prompt_routes.dtype, device=prompt_routes.device))
    return torch.cat(pieces)


def unpack_row(row: torch.Tensor, prompt_lengths: Sequence[int], response_lengths: Sequence[int],
               prompt_width: int, response_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack_row`: `([n, prompt_width, L, k] left-padded, [n, response_width, L, k]
    right-padded)`, -1 at padding."""
    n, L, k = len(prompt_lengths), row.shape[1], row.shape[2]
    prompt = torch.full((n, prompt_width, L, k), -1, dtype=row.dtype, device=row.device)
    response = torch.full((n, response_width, L, k), -1, dtype=row.dtype, device=row.device)
    at = 0
    for i, (p, r) in enumerate(zip(prompt_lengths, response_lengths)):
        p, r = int(p), int(r)
        prompt[i, prompt_width - p:] = row[at:at + p]
        response[i, :r] = row[at + p:at + p + r]
        at += p + r
    return prompt, response


def sp_slice(row: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's part of a row's tokens under sequence parallelism (megatron scatters the
    sequence dimension into `tp` equal contiguous chunks before the layers)."""
    if tp == 1:
        return row
    if row.shape[0] % tp:
        raise ValueError(f"a row of {row.shape[0]} tokens does not split over {tp} sequence-parallel ranks")
    per = row.shape[0] // tp
    return row[tp_rank * per:(tp_rank + 1) * per]


def same_experts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`[N]` bool: whether each token's top-k expert set in `a [N, k]` equals the one in `b`
    (order inside the top-k does not matter: the routed output does not depend on it)."""
    return (a.long().sort(-1).values == b.long().sort(-1).values).all(-1)


def load_ratio(counts: torch.Tensor) -> torch.Tensor:
    """Per layer, the busiest expert's tokens over the mean tokens per expert (`counts [L, E]`);
    1 is a perfectly balanced layer, E the worst. Layers that saw no token give 1."""
    counts = counts.double()
    mean = counts.mean(-1)
    return torch.where(mean > 0, counts.max(-1).values / mean.clamp(min=1e-12), torch.ones_like(mean))


# ---------------------------------------------------------------------------- megatron hooks

class ObservingReplay:
    """A router's replay hook (megatron's `RouterReplay` interface, `get_replay_topk`): computes
    the router's own top-k every time (`natural`), and returns the routes of `target` (rows with
    a -1 keep the router's own) when one is set. Not registered in megatron's global instance list:
    `RouterHooks` drives each model's routers itself, so an actor and a reference never mix."""

    def __init__(self):
        self.target: Optional[torch.Tensor] = None
        self.natural: Optional[torch.Tensor] = None
        self.used: Optional[torch.Tensor] = None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        probs, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        self.natural = idx.detach()
        if self.target is None:
            self.used = self.natural
            return probs, idx
        target = self.target.to(device=scores.device, dtype=torch.long)
        if target.shape != idx.shape:
            raise RuntimeError(f"routing replay: {tuple(target.shape)} routes for a router that routes "
                               f"{tuple(idx.shape)} (tokens x top-k)")
        keep = (target < 0).any(-1, keepdim=True)
        top = torch.where(keep, idx, target)
        self.used = top.detach()
        return scores.gather(1, top), top


@dataclasses.dataclass
class RouteStats:
    """Counts over one pass (summed over this rank's micro-batches), per MoE layer of the model."""

    agree: torch.Tensor        # [L] tokens whose own top-k equals the rollout's
    compared: torch.Tensor     # [L] tokens with rollout routes
    load: torch.Tensor         # [L, E] tokens per expert (the routes used)


class RouterHooks:
    """Routing replay and observation for one model's chunks on this rank.

    Per micro-batch the engine calls `before(chunk, mb)` (sets each router's target: the
    micro-batch's `replay_from` routes, or none) and `after(chunk, mb)` (counts agreement with the
    rollout's routes and expert load; records the router's own routes when `record` is on), and
    `end_pass()` after a pass. `replay_from` ("rollout", "trainer" or None) and `record` are set
    by the caller between passes; `first_pass_stats` are the counts of the first pass since
    `reset()` (the pass on the weights that generated the rollout)."""

    def __init__(self, chunks: Sequence, config):
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.router import TopKRouter

        self.layers = moe_layer_numbers(config.num_layers, config.moe_layer_freq)
        self.experts = int(config.num_moe_experts)
        self.topk = int(config.moe_router_topk)
        self.sp = bool(config.sequence_parallel)
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        ordinal = {n: i for i, n in enumerate(self.layers)}
        self.routers: dict[int, list[tuple[int, ObservingReplay]]] = {}
        for chunk in chunks:
            found = []
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    if module.layer_number not in ordinal:
                        raise RuntimeError(f"routing: a router in layer {module.layer_number}, not an MoE layer "
                                           f"of {self.layers}")
                    hook = ObservingReplay()
                    module.router_replay = hook
                    found.append((ordinal[module.layer_number], hook))
            self.routers[id(chunk)] = found
            inner = getattr(chunk, "module", None)   # DDP wraps the chunk the schedule calls
            while inner is not None:
                self.routers[id(inner)] = found
                inner = getattr(inner, "module", None)
        self.replay_from: Optional[str] = None
        self.record = False
        self.recorded: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.reset()

    def reset(self) -> None:
        """Start a step: forget the first pass's counts and any record."""
        self.first_pass_stats: Optional[RouteStats] = None
        self._stats = self.empty_stats()
        self.recorded = []
        self._train_calls = 0

    def empty_stats(self) -> RouteStats:
        L = len(self.layers)
        return RouteStats(agree=torch.zeros(L, dtype=torch.float64), compared=torch.zeros(L, dtype=torch.float64),
                          load=torch.zeros(L, self.experts, dtype=torch.float64))

    def _local(self, row: torch.Tensor) -> torch.Tensor:
        return sp_slice(row, self.tp_rank, self.tp) if self.sp else row

    def before(self, chunk, mb) -> None:
        target = mb.routes.get(self.replay_from) if self.replay_from else None
        if self.replay_from and target is None:
            raise RuntimeError(f"routing replay from {self.replay_from!r}, but the micro-batch carries no such routes")
        local = self._local(target) if target is not None else None
        for layer, hook in self.routers.get(id(chunk), ()):
            hook.target = None if local is None else local[:, layer]
            hook.natural = hook.used = None

    def after(self, chunk, mb) -> None:
        hooks = self.routers.get(id(chunk), ())
        if not hooks:
            return
        if any(hook.natural is None for _, hook in hooks):
            raise RuntimeError("routing: a router did not report its routes (megatron's fused router, "
                               "moe_router_fusion, bypasses the replay hook)")
        if torch.is_grad_enabled():
            self._train_calls += len(hooks)
        start = self.tp_rank * (mb.row_tokens // self.tp) if self.sp and self.tp > 1 else 0
        real = mb.real[start:start + hooks[0][1].natural.shape[0]].cpu()   # padding excluded (under CP too)
        rollout = mb.routes.get("rollout")
        rollout = self._local(rollout) if rollout is not None else None
        for layer, hook in hooks:
            natural, used = hook.natural.cpu(), hook.used.cpu()
            self._stats.load[layer] += torch.bincount(used[real].reshape(-1), minlength=self.experts).double()
            if rollout is not None:
                ref = rollout[:, layer].cpu()
                known = real & (ref >= 0).all(-1)
                self._stats.agree[layer] += float(same_experts(natural[known], ref[known]).sum())
                self._stats.compared[layer] += float(known.sum())
            hook.target = None
        if self.record:
            self._record(hooks, mb)

    def _record(self, hooks, mb) -> None:
        """This chunk's own routes of `mb`, whole row (gathered over TP under sequence parallelism),
        unpacked to the micro-batch's responses; layers of other pipeline stages stay -1."""
        L, T = len(self.layers), mb.row_tokens
        row = torch.full((T, L, self.topk), -1, dtype=ROUTE_DTYPE)   # the local row (this CP rank's chunks)
        for layer, hook in hooks:
            local = hook.natural.sort(-1).values.to(ROUTE_DTYPE)
            if self.sp and self.tp > 1:
                parts = [torch.empty_like(local) for _ in range(self.tp)]
                torch.distributed.all_gather(parts, local.contiguous(), group=self.tp_group)
                local = torch.cat(parts)
            row[:, layer] = local.cpu()
        # sequences back to back (gathered over CP; int32 on the wire, which every backend takes)
        row = mb.whole_row(row.to(mb.tokens.device, torch.int32)).to(ROUTE_DTYPE).cpu()
        sub = mb.batch
        prompt, response = unpack_row(row, sub.prompt_lengths.tolist(), sub["response_lengths"].tolist(),
                                      sub["prompt_ids"].shape[1], sub.response_width)
        self.recorded.append((mb.index.cpu(), prompt, response))

    def take_train_calls(self) -> int:
        """Router calls (layers x micro-batches) with gradients since the last call: what
        megatron's aux-loss tracker summed over."""
        calls, self._train_calls = self._train_calls, 0
        return calls

    def end_pass(self) -> None:
        if self.first_pass_stats is None:
            self.first_pass_stats = self._stats
        self._stats = self.empty_stats()

    def take_recorded(self, batch) -> dict[str, torch.Tensor]:
        """The recorded routes of the last recording pass over `batch`, as `trainer_*` fields
        (this stage's layers; -1 elsewhere)."""
        L = len(self.layers)
        prompt = torch.full((len(batch), batch["prompt_ids"].shape[1], L, self.topk), -1, dtype=ROUTE_DTYPE)
        response = torch.full((len(batch), batch.response_width, L, self.topk), -1, dtype=ROUTE_DTYPE)
        for index, p, r in self.recorded:
            prompt[index] = torch.where(p >= 0, p, prompt[index])
            response[index] = torch.where(r >= 0, r, response[index])
        self.recorded = []
        return {"trainer_prompt_routes": prompt, "trainer_response_routes": response}
