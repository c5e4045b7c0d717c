"""Token-balanced micro-batches: plan which responses go together, then pack them into one row.

`plan` assigns sequences (prompt + response, padding removed) to as few micro-batches as a
per-rank token budget allows, balancing their token counts (longest first onto the lightest
micro-batch). `pack` lays one micro-batch out as a single row `[1, T]` of concatenated
sequences with per-sequence position ids and megatron's `PackedSeqParams` in the `thd` layout
(`cu_seqlens`): every attention backend (`mrl.models.attention`) reads the sequence boundaries
from them, RoPE restarts at each sequence, and no `[T, T]` mask is ever built.

MoE routes in the batch (`rollout_*_routes`, `trainer_*_routes`: `mrl.engine.routing`) are laid
out along the row the same way (`MicroBatch.routes`).

A `MicroBatch` knows where each response token sits in the row, so a role's output
`[1, T, ...]` is cut to the response tokens (`take`) and laid back out as `[n, R]` (`to_padded`).
The engine runs the output layer at those rows only (`head_rows`, `mrl.models.head`): its
output is then `[1, N, ...]` and `take` only checks it.
"""
from __future__ import annotations

import dataclasses
import heapq
from typing import Any, Optional, Sequence

import torch

from mrl.batch import Batch
from mrl.engine.routing import pack_row
from mrl.errors import UserError

ROUTE_SOURCES = ("rollout", "trainer")   # `<source>_prompt_routes` / `_response_routes` batch fields

__all__ = ["plan", "pack", "MicroBatch"]


def plan(lengths: Sequence[int], budget: int, *, min_micro_batches: int = 1,
         budget_name: str = "micro_batch_tokens") -> list[list[int]]:
    """Indices of the sequences in each micro-batch: every micro-batch holds at most `budget`
    tokens, their number is the smallest for which longest-first placement onto the lightest
    micro-batch fits (starting at ceil(total / budget); at least `min_micro_batches`, capped at
    the number of sequences), and their token counts are balanced by that placement. Indices inside a micro-batch are ascending; micro-batches are ordered by their
    first index, so the plan is deterministic.

    A single sequence longer than the budget is a `UserError` naming `budget_name`.
    """
    lengths = [int(x) for x in lengths]
    if not lengths:
        return []
    longest = max(lengths)
    if longest > budget:
        raise UserError(f"{budget_name} = {budget} is smaller than the longest sequence ({longest} tokens: "
                        "prompt + response); raise it to at least that")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    count = max(min_micro_batches, -(-sum(lengths) // budget))
    count = min(count, len(lengths))
    while True:
        bins = _fill(order, lengths, count, budget)
        if bins is not None:
            break
        count += 1
    return sorted((sorted(b) for b in bins if b), key=lambda b: b[0])


def _fill(order: list[int], lengths: list[int], count: int, budget: int) -> Optional[list[list[int]]]:
    """Longest-first onto the lightest bin that still fits; None when some sequence fits nowhere."""
    heap = [(0, k) for k in range(count)]  # (tokens, bin)
    bins: list[list[int]] = [[] for _ in range(count)]
    for i in order:
        skipped = []
        while heap and heap[0][0] + lengths[i] > budget:
            skipped.append(heapq.heappop(heap))
        if not heap:
            return None
        load, k = heapq.heappop(heap)
        bins[k].append(i)
        heapq.heappush(heap, (load + lengths[i], k))
        for s in skipped:
            heapq.heappush(heap, s)
    return bins


@dataclasses.dataclass(frozen=True)
class CPShare:
    """How a micro-batch's response tokens are spread over the CP group: `counts[r]` are rank r's,
    `order` puts the padded all-gather back in response order (`context_parallel.gather_tokens`),
    `row` rebuilds the plain row (sequences back to back) from the all-gathered local rows."""

    layout: Any                          # mrl.models.context_parallel.CPLayout (this rank)
    counts: tuple
    order: torch.Tensor
    row: torch.Tensor                    # [used] position in the gathered rows of each plain-row token


@dataclasses.dataclass
class MicroBatch:
    """One packed micro-batch: the model's inputs and the map back to `[n, R]` responses.

    Under context parallelism the row is this CP rank's share (`cp`): `tokens`, `position_ids`,
    `response_positions`, `response_labels` and `routes` are local; `gather` makes per-token
    values whole; `response_rows`/`response_cols`, `sequence_tokens` and `loss_tokens` describe
    the whole micro-batch."""

    index: torch.Tensor                  # [n] rows of the mini-batch this micro-batch holds
    batch: Batch                         # those responses, padded [n, R] as in the mini-batch
    tokens: torch.Tensor                 # [1, T] concatenated sequences (+ padding at the end)
    position_ids: torch.Tensor           # [1, T] 0.. per sequence ([3, 1, T] mRoPE ids in a row with images)
    packed_seq_params: Any               # megatron PackedSeqParams (thd)
    response_positions: torch.Tensor     # [N] row positions whose next token is a response token
    response_labels: torch.Tensor        # [N] that next token (= response_ids)
    response_rows: torch.Tensor          # [N] where each lands in [n, R]
    response_cols: torch.Tensor          # [N]
    sequence_tokens: int                 # tokens of real sequences in the row (padding excluded)
    loss_tokens: int                     # response tokens with response_mask = 1
    routes: dict = dataclasses.field(default_factory=dict)   # source -> [T, L, k] MoE routes (`routing`)
    real: Optional[torch.Tensor] = None  # [T] bool: real tokens of the (local) row, padding False
    cp: Optional[CPShare] = None         # context parallelism: this rank's share
    vision: dict = dataclasses.field(default_factory=dict)   # pixel_values / image_grid_thw of the row's images
    head_rows: bool = False              # the model's output layer ran at `response_positions` only (`mrl.models.head`)

    @property
    def row_tokens(self) -> int:
        return self.tokens.shape[1]

    def take(self, output: torch.Tensor) -> torch.Tensor:
        """The response-token rows `[N, ...]` of a model output `[1, T, ...]` (differentiable;
        under CP this rank's response tokens, in its local order: `gather` makes them whole).
        With `head_rows` the engine ran the output layer at those rows only (`[1, N, ...]`)."""
        if not self.head_rows:
            return output[0].index_select(0, self.response_positions)
        if output.shape[1] != self.response_positions.numel():
            raise ValueError(f"model output has {output.shape[1]} rows, the micro-batch "
                             f"{self.response_positions.numel()} response positions: run the model under "
                             "mrl.models.head.at_rows")
        return output[0]

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """Per-response-token values `[N_local, ...]` of `take` -> `[N, ...]` of the whole micro-batch
        (all-gathered over the CP group, differentiable; identity without CP)."""
        if self.cp is None:
            return flat
        from mrl.models.context_parallel import gather_tokens

        return gather_tokens(flat, self.cp.counts, self.cp.order, self.cp.layout.group)

    def to_padded(self, flat: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Lay per-response-token values `[N, ...]` out as `[n, R, ...]` (`fill` at padding)."""
        n, r = len(self.batch), self.batch.response_width
        out = flat.new_full((n, r, *flat.shape[1:]), fill)
        return out.index_put((self.response_rows, self.response_cols), flat)

    def whole_row(self, local: torch.Tensor) -> torch.Tensor:
        """A per-token tensor of the local row `[T_local, ...]` -> the plain row of the micro-batch's
        sequences back to back `[sequence_tokens, ...]` (all-gathered over CP, no gradient)."""
        if self.cp is None:
            return local[:self.sequence_tokens]
        parts = [torch.empty_like(local) for _ in range(self.cp.layout.size)]
        torch.distributed.all_gather(parts, local.contiguous(), group=self.cp.layout.group)
        return torch.cat(parts).index_select(0, self.cp.row.to(local.device))


def pack(batch: Batch, index: Sequence[int], *, pad_to_multiple: int = 1,
         device: torch.device | str = "cpu", cp_size: int = 1, cp_rank: int = 0, cp_group=None) -> MicroBatch:
    """Pack the responses `index` of `batch` into one row (see the module docstring).

    `pad_to_multiple` pads the row length (sequence parallelism needs a multiple of TP); the
    padding is a sequence of its own that attends only to itself. With `cp_size > 1` every
    sequence is padded to a multiple of 2 x cp_size and the row holds CP rank `cp_rank`'s chunks
    (`mrl.models.context_parallel`); the row padding then makes the local row a multiple of
    `pad_to_multiple`.
    """
    idx = torch.as_tensor(list(index), dtype=torch.long)
    sub = batch.select(idx)
    p_width = sub["prompt_ids"].shape[1]
    p_lens = sub.prompt_lengths.tolist()
    r_lens = sub["response_lengths"].tolist()
    pieces, positions = [], []
    resp_pos, resp_rows, resp_cols = [], [], []
    offset = 0
    for i, (p, r) in enumerate(zip(p_lens, r_lens)):
        if p < 1:
            raise ValueError(f"response {int(idx[i])} has an empty prompt; the first response token needs a context")
        seq = torch.cat([sub["prompt_ids"][i, p_width - p:], sub["response_ids"][i, :r]])
        pieces.append(seq)
        positions.append(torch.arange(p + r))
        resp_pos.append(torch.arange(offset + p - 1, offset + p - 1 + r))
        resp_rows.append(torch.full((r,), i, dtype=torch.long))
        resp_cols.append(torch.arange(r))
        offset += p + r
    used = offset
    flat_pos = torch.cat(resp_pos) if resp_pos else torch.zeros(0, dtype=torch.long)
    rows = torch.cat(resp_rows) if resp_rows else torch.zeros(0, dtype=torch.long)
    cols = torch.cat(resp_cols) if resp_cols else torch.zeros(0, dtype=torch.long)
    labels = sub["response_ids"][rows, cols]
    loss_tokens = int((sub["response_mask"] > 0).sum())
    seq_lens = [p + r for p, r in zip(p_lens, r_lens)]
    if cp_size > 1:
        return _pack_cp(sub, idx, pieces, seq_lens, flat_pos, rows, cols, labels, loss_tokens, pad_to_multiple,
                        device, cp_size, cp_rank, cp_group)
    row = -(-used // pad_to_multiple) * pad_to_multiple
    if row > used:  # padding: its own block, attending to itself only
        pieces.append(torch.zeros(row - used, dtype=torch.long))
        positions.append(torch.arange(row - used))
    tokens = torch.cat(pieces).unsqueeze(0)
    pos = torch.cat(positions).unsqueeze(0)
    routes = {src: pack_row(sub[f"{src}_prompt_routes"], sub[f"{src}_response_routes"], p_lens, r_lens, row).to(device)
              for src in ROUTE_SOURCES if f"{src}_prompt_routes" in sub}
    vision = {}
    items = sub.meta.get("prompt_item") or []
    if any(getattr(it, "images", None) is not None for it in items):
        pos, vision = _vision_row(items, p_lens, r_lens, row - used, pos)
    packed = _thd_params(seq_lens + ([row - used] if row > used else []), device)
    return MicroBatch(index=idx, batch=sub.to(device), tokens=tokens.to(device), position_ids=pos.to(device),
                      packed_seq_params=packed, response_positions=flat_pos.to(device),
                      response_labels=labels.to(device), response_rows=rows.to(device),
                      response_cols=cols.to(device), sequence_tokens=used,
                      loss_tokens=loss_tokens, routes=routes, real=(torch.arange(row) < used).to(device),
                      vision={k: v.to(device) for k, v in vision.items()})


def _vision_row(items, p_lens: list[int], r_lens: list[int], padding: int,
                plain: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """A row with images (vision-language models): `[3, 1, T]` mRoPE ids (each prompt's own from its
    `ImageInputs`, its response counting on from one past the prompt's largest id, text-only
    prompts the same id thrice) and the row's images in row order. Ids that cover the whole
    sequence (an SFT example, whose images may follow its first trained token) are taken whole.
    A model without mRoPE (Gemma 3: `ImageInputs` without a grid) keeps the row's plain ids
    `plain` and gets its images' pixels only."""
    with_images = [it.images for it in items if getattr(it, "images", None) is not None]
    if all(img.image_grid_thw is None for img in with_images):
        return plain, dict(pixel_values=torch.cat([img.pixel_values for img in with_images]))
    parts, pixels, grids = [], [], []
    for it, p, r in zip(items, p_lens, r_lens):
        img = getattr(it, "images", None)
        prompt = img.prompt_positions if img is not None else torch.arange(p).expand(3, p)
        if prompt.shape[1] == p + r and r:
            parts.append(prompt)
        elif prompt.shape[1] != p:
            raise ValueError(f"mRoPE ids for {prompt.shape[1]} prompt tokens, the prompt has {p}")
        else:
            start = int(prompt.max()) + 1 if p else 0
            parts += [prompt, (start + torch.arange(r)).expand(3, r)]
        if img is not None:
            pixels.append(img.pixel_values)
            grids.append(img.image_grid_thw)
    if padding:
        parts.append(torch.arange(padding).expand(3, padding))
    return torch.cat(parts, dim=1).unsqueeze(1), dict(pixel_values=torch.cat(pixels), image_grid_thw=torch.cat(grids))


def _pack_cp(sub, idx, pieces, seq_lens, flat_pos, rows, cols, labels, loss_tokens, pad_to_multiple, device,
             size, rank, group) -> MicroBatch:
    """`pack` under context parallelism: pad each sequence to 2N chunks, add a padding sequence
    so the local row is a multiple of `pad_to_multiple`, and keep CP rank `rank`'s tokens."""
    from mrl.models import context_parallel as C

    used = sum(seq_lens)
    padded = [C.padded_length(n, size) for n in seq_lens]
    unit = 2 * size * pad_to_multiple
    total = -(-sum(padded) // unit) * unit
    lengths = padded + ([total - sum(padded)] if total > sum(padded) else [])
    # plain row (sequences back to back) -> padded row
    to_padded = torch.cat([torch.arange(n) + start for n, start in
                           zip(seq_lens, torch.tensor([0] + padded).cumsum(0).tolist())]) if seq_lens else \
        torch.zeros(0, dtype=torch.long)
    full = torch.zeros(total, dtype=torch.long)
    full[to_padded] = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    real = torch.zeros(total, dtype=torch.bool)
    real[to_padded] = True
    lay = C.layout(lengths, size, rank, group)
    everyone = [C.rank_index(lengths, size, r)[0] for r in range(size)]
    local_of = torch.full((total,), -1, dtype=torch.long)
    owner = torch.empty(total, dtype=torch.long)
    for r, ix in enumerate(everyone):
        local_of[ix] = torch.arange(ix.numel())
        owner[ix] = r
    resp_padded = to_padded[flat_pos] if flat_pos.numel() else flat_pos
    resp_owner = owner[resp_padded]
    mine = resp_owner == rank
    numbers = [torch.nonzero(resp_owner == r).flatten() for r in range(size)]
    counts = tuple(int(x.numel()) for x in numbers)
    order = C.token_order(counts, numbers, int(flat_pos.numel()))
    gathered_at = lay.inverse   # row position -> position in the ranks' concatenated local rows
    share = CPShare(layout=lay.to(device), counts=counts, order=order.to(device),
                    row=gathered_at[to_padded].to(device))
    routes = {}
    for src in ROUTE_SOURCES:
        if f"{src}_prompt_routes" in sub:
            plain = pack_row(sub[f"{src}_prompt_routes"], sub[f"{src}_response_routes"], sub.prompt_lengths.tolist(),
                             sub["response_lengths"].tolist(), used)
            whole = torch.full((total, *plain.shape[1:]), -1, dtype=plain.dtype)
            whole[to_padded] = plain
            routes[src] = whole[lay.index].to(device)
    packed = _thd_params([2 * (n // (2 * size)) for n in lengths], device, longest=max(lengths))
    packed.mrl_cp = share.layout
    return MicroBatch(index=idx, batch=sub.to(device), tokens=full[lay.index].unsqueeze(0).to(device),
                      position_ids=lay.positions.unsqueeze(0).to(device), packed_seq_params=packed,
                      response_positions=local_of[resp_padded[mine]].to(device),
                      response_labels=labels[mine].to(device), response_rows=rows.to(device),
                      response_cols=cols.to(device), sequence_tokens=used, loss_tokens=loss_tokens,
                      routes=routes, real=real[lay.index].to(device), cp=share)


def _thd_params(lengths: list[int], device, longest: Optional[int] = None):
    """megatron's packed-sequence description (cumulative sequence starts, longest sequence;
    under CP the local row's sequences and the longest whole sequence, for RoPE's table)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.as_tensor(lengths, dtype=torch.int32), 0)
    cu = cu.to(device)
    longest = max(lengths) if longest is None else longest
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                           cu_seqlens_kv_padded=cu, max_seqlen_q=longest, max_seqlen_kv=longest)
