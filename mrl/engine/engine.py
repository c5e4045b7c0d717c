"""`Engine`: a megatron-core model (actor, critic, reference) driven by megatron's pipeline schedule.

Role-agnostic: a role supplies callbacks on the model output of one packed micro-batch, read
through `mb.take` at its response positions. The output layer runs at those positions only
(`mrl.models.head.at_rows`: the LM head on prompt tokens would be thrown away), so the output
is `[1, N, V/tp]` logits for a language model, `[1, N, 1]` for a value head:

- `LossFn(output, mb, totals) -> (loss, metrics)`: `loss` is this micro-batch's share of the
  mini-batch loss, aggregated with the global counts in `totals` (`mrl.algos.losses.aggregate(...,
  global_tokens=totals.tokens, global_sequences=totals.sequences)`, dp_size left at 1), so the sum
  over micro-batches and DP ranks *is* the mini-batch loss. `metrics` are means over the
  micro-batch's valid response tokens (0-dim tensors or floats).
- `OutputFn(output, mb) -> {name: [N]}`: per-response-token values (log-probs, entropy, values).

Scaling. megatron's schedule divides each micro-batch loss by the number of micro-batches (and
multiplies it by the CP size) and DDP averages gradients over DP x CP; the engine backpropagates
`loss * micro_batches * dp` to cancel both, so gradients are those of the mini-batch loss
whatever the split (docs/algorithms.md, token-mean). `calculate_per_token_loss` stays off (it
would only serve token-mean).

Context parallelism (`parallel.context = N`, `mrl.models.context_parallel`): every CP rank of a
DP rank gets the same batch and packs the same micro-batches, each keeping its chunks of every
sequence. Callbacks take this rank's response tokens (`mb.take`) and make per-token values
whole with `mb.gather` (an all-gather over CP), so every CP rank computes the whole
micro-batch's loss with whole-batch token counts; a rank's gradient is that loss's gradient
through its own tokens, and the sum over CP ranks (the DDP reduction, times the N above) is the
whole gradient (megatron's CP factor in the schedule cancels DDP's average over CP).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Callable, Optional

import torch

from mrl.batch import Batch
from mrl.engine import packing
from mrl.engine.packing import MicroBatch
from mrl.models.head import at_rows
from mrl.optim.step import StepOutcome, guarded_step

log = logging.getLogger(__name__)

__all__ = ["Engine", "Totals", "LossFn", "OutputFn"]


@dataclasses.dataclass(frozen=True)
class Totals:
    """Global counts of one mini-batch (all micro-batches, all DP ranks)."""

    tokens: torch.Tensor      # valid loss tokens (response_mask)
    sequences: torch.Tensor   # responses with at least one valid token
    dp_size: int
    rows: Optional[torch.Tensor] = None   # all responses, fully masked ones too (losses.ALL_ROWS_LOSSES)


LossFn = Callable[[torch.Tensor, MicroBatch, Totals], "tuple[torch.Tensor, dict]"]
OutputFn = Callable[[torch.Tensor, MicroBatch], "dict[str, torch.Tensor]"]


class Engine:
    """Forward/backward, optimizer steps and eval passes for one model on this rank.

    `chunks` are the model's virtual-pipeline chunks on this rank, wrapped in megatron DDP when
    the engine trains (`optimizer` given); a frozen model (reference) passes bare chunks and no
    optimizer. `name` ("actor", "critic", ...) names the stage in errors and logs. `head_rows`
    False runs the output layer over the whole packed row, as before it ran at the response
    positions only (the equivalence checks and `tools/bench/train_step.py` compare the two).
    """

    def __init__(self, chunks: list, *, optimizer=None, scheduler=None, name: str = "actor",
                 grad_clip: float = 0.0, nonfinite: str = "stop", head_rows: bool = True):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import finalize_model_grads

        self.chunks = list(chunks)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.name = name
        self.grad_clip = grad_clip
        self.nonfinite = nonfinite
        self.head_rows = head_rows
        self.config = self.chunks[0].config
        self.device = next(self.chunks[0].parameters()).device
        self.dp = ps.get_data_parallel_world_size()
        self.dp_group = ps.get_data_parallel_group()
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.cp = ps.get_context_parallel_world_size()
        self.cp_rank = ps.get_context_parallel_rank()
        self.cp_group = ps.get_context_parallel_group() if self.cp > 1 else None
        self.last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.pp_last_rank = ps.get_pipeline_model_parallel_last_rank()
        self.pad_multiple = self.tp if self.config.sequence_parallel else 1
        if self.pp > 1:
            # micro-batches are packed rows of different lengths: exchange shapes between stages
            self.config.variable_seq_lengths = True
        if optimizer is not None:
            self.config.finalize_model_grads_func = finalize_model_grads
            self.config.grad_scale_func = optimizer.scale_loss
            no_sync = [c.no_sync for c in self.chunks]
            self.config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        self.steps = 0  # optimizer updates attempted (skipped ones included)
        self.routing = None   # `mrl.engine.routing.RouterHooks` of an MoE model (`attach_routing`)

    def attach_routing(self):
        """Give every router of this (MoE) model a replay hook (`mrl.engine.routing`); returns them."""
        from mrl.engine.routing import RouterHooks

        self.routing = RouterHooks(self.chunks, self.config)
        return self.routing

    # ---------------------------------------------------------------- packing

    def micro_batches(self, batch: Batch, budget: int, budget_name: str) -> list[MicroBatch]:
        """Token-balanced packed micro-batches of this rank's `batch`; every DP rank gets the same
        number (the largest any rank needs), which keeps their work balanced. `budget` is tokens
        per rank: under CP a micro-batch holds up to `budget x N` tokens of sequences padded to
        2N chunks, `budget` on each CP rank."""
        lengths = batch.sequence_lengths.tolist()
        if self.cp > 1:   # the budget is per CP rank; every sequence is padded to 2N chunks
            from mrl.models.context_parallel import padded_length

            lengths = [padded_length(n, self.cp) for n in lengths]
            budget, budget_name = budget * self.cp, f"{budget_name} x parallel.context {self.cp}"
        plan = packing.plan(lengths, budget, min_micro_batches=1, budget_name=budget_name)
        count = torch.tensor([len(plan), self.pp if self.pp > 1 else 1], dtype=torch.long, device=self.device)
        if self.dp > 1:
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX, group=self.dp_group)
        want = min(int(count.max()), len(lengths))
        if want > len(plan):
            plan = packing.plan(lengths, budget, min_micro_batches=want, budget_name=budget_name)
        return [packing.pack(batch, idx, pad_to_multiple=self.pad_multiple, device=self.device, cp_size=self.cp,
                             cp_rank=self.cp_rank, cp_group=self.cp_group) for idx in plan]

    # ---------------------------------------------------------------- schedule

    def _run(self, mbs: list[MicroBatch], step_fn, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            if self.routing is not None:
                self.routing.before(model, mb)
            mb.head_rows = self.head_rows   # every callback reads the response positions (`MicroBatch.take`)
            with at_rows(model, mb.response_positions) if self.head_rows else contextlib.nullcontext():
                output = model(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params, **mb.vision)
            if self.routing is not None:
                self.routing.after(model, mb)
            return output, step_fn(mb)

        multi = len(self.chunks) > 1
        iterators = [iter(mbs) for _ in self.chunks] if multi else iter(mbs)
        store = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators,
            model=self.chunks if multi else self.chunks[0], num_microbatches=len(mbs),
            seq_length=max(mb.row_tokens for mb in mbs), micro_batch_size=1, forward_only=forward_only)
        if self.routing is not None:
            self.routing.end_pass()
        return store

    # ---------------------------------------------------------------- training

    def totals(self, batch: Batch) -> Totals:
        """Valid loss tokens, non-empty responses and all responses of the global mini-batch (all DP
        ranks)."""
        mask = batch["response_mask"].to(self.device) > 0
        rows = torch.tensor(mask.shape[0], device=self.device)
        t = torch.stack([mask.sum(), (mask.sum(-1) > 0).sum(), rows]).to(torch.float64).contiguous()
        if self.dp > 1:
            torch.distributed.all_reduce(t, group=self.dp_group)
        return Totals(tokens=t[0], sequences=t[1], dp_size=self.dp, rows=t[2])

    def forward_backward(self, batch: Batch, loss_fn: LossFn, *, micro_batch_tokens: int,
                         budget_name: str = "micro_batch_tokens") -> dict:
        """Accumulate the gradients of this rank's share of a mini-batch in the DDP buffers (DP
        reduced, megatron's `finalize_model_grads`); no update. Returns `loss`, the callback's
        metrics (token-weighted means) and `micro_batches`, equal on every rank."""
        if self.optimizer is None:
            raise RuntimeError(f"{self.name}: engine has no optimizer (a frozen model)")
        for c in self.chunks:
            c.train()
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        mbs = self.micro_batches(batch, micro_batch_tokens, f"{self.name}.{budget_name}")
        totals = self.totals(batch)
        scale = len(mbs) * self.dp   # megatron's schedule multiplies by CP itself (see the module docstring)

        def step_fn(mb):
            def loss_func(output):
                loss, metrics = loss_fn(output, mb, totals)
                report = {"loss": loss.detach(), "weight": mb.loss_tokens,
                          **{k: v.detach() if torch.is_tensor(v) else v for k, v in metrics.items()}}
                return loss * scale, report  # the schedule divides by len(mbs) in place

            return loss_func

        from mrl.platform import stage

        with stage(f"{self.name} forward/backward"):
            store = self._run(mbs, step_fn, forward_only=False)
        metrics = self._reduce(store)
        metrics["micro_batches"] = float(len(mbs))
        return metrics

    def train_mini_batch(self, batch: Batch, loss_fn: LossFn, *, micro_batch_tokens: int,
                         budget_name: str = "micro_batch_tokens", step: Optional[int] = None) -> dict:
        """One optimizer update from this rank's share of a mini-batch: `forward_backward`, then the
        guarded step (`mrl.optim.step`). Adds `grad_norm` (before clipping), `lr` and `updated`
        (0 when a non-finite update was skipped) to the metrics."""
        metrics = self.forward_backward(batch, loss_fn, micro_batch_tokens=micro_batch_tokens,
                                        budget_name=budget_name)
        step = self.steps if step is None else step
        from mrl.platform import stage

        with stage(f"{self.name} optimizer step"):
            outcome: StepOutcome = guarded_step(self.optimizer, self.scheduler, loss=metrics["loss"],
                                                clip=self.grad_clip, policy=self.nonfinite,
                                                where=f"step {step} ({self.name} update)")
        self.steps += 1
        metrics.update(grad_norm=outcome.grad_norm, lr=outcome.lr, updated=float(outcome.updated))
        return metrics

    @staticmethod
    def mini_batch_plan(batch: Batch, *, mini_batches: int, epochs: int = 1, shuffle: bool = False, seed: int = 0,
                        step: Optional[int] = None) -> list[tuple[int, Batch]]:
        """`(epoch, mini-batch)` in the order `update` trains them: each epoch splits `batch` into
        `mini_batches` mini-batches of whole prompts; with `shuffle` the prompts are permuted per
        epoch by a generator seeded from (`seed`, `step`, epoch), so a resumed or repeated run
        sees the same order and each epoch draws its own permutation."""
        plan = []
        for epoch in range(epochs):
            gen = torch.Generator().manual_seed(((seed * 1_000_003 + (step or 0)) * 1_009 + epoch) % 2**63)
            plan.extend((epoch, mb) for mb in batch.mini_batches(mini_batches, shuffle=shuffle, generator=gen))
        return plan

    def update(self, batch: Batch, loss_fn: LossFn, *, micro_batch_tokens: int, mini_batches: int,
               epochs: int = 1, shuffle: bool = False, seed: int = 0, step: Optional[int] = None,
               budget_name: str = "micro_batch_tokens") -> list[dict]:
        """PPO-style update over this rank's share of a step's batch: `epochs` passes, each split
        into `mini_batches` optimizer updates of whole prompts (`mini_batch_plan`). Returns the
        metrics of every update, with its `epoch`."""
        out = []
        for epoch, mb in self.mini_batch_plan(batch, mini_batches=mini_batches, epochs=epochs, shuffle=shuffle,
                                              seed=seed, step=step):
            m = self.train_mini_batch(mb, loss_fn, micro_batch_tokens=micro_batch_tokens, budget_name=budget_name,
                                      step=step)
            out.append({**m, "epoch": float(epoch)})
        return out

    def _reduce(self, store: list) -> dict:
        """Mini-batch loss (sum over micro-batches and DP) and token-weighted metric means, from the
        last pipeline stage to every rank."""
        result = None
        if self.last_stage:
            keys = sorted(k for k in (store[0] if store else {}) if k not in ("loss", "weight"))
            vec = torch.zeros(2 + len(keys), dtype=torch.float64, device=self.device)
            for rec in store:
                vec[0] += torch.as_tensor(rec["loss"]).to(vec)
                vec[1] += rec["weight"]
                for j, k in enumerate(keys):
                    vec[2 + j] += torch.as_tensor(rec[k]).to(vec) * rec["weight"]
            if self.dp > 1:
                torch.distributed.all_reduce(vec, group=self.dp_group)
            result = {"loss": float(vec[0]), **{k: float(vec[2 + j] / max(float(vec[1]), 1.0))
                                                for j, k in enumerate(keys)}}
        if self.pp > 1:
            box = [result]
            torch.distributed.broadcast_object_list(box, src=self.pp_last_rank, group=self.pp_group)
            result = box[0]
        return result

    # ---------------------------------------------------------------- eval passes

    @torch.no_grad()
    def forward_only(self, batch: Batch, output_fn: OutputFn, *, micro_batch_tokens: int,
                     budget_name: str = "micro_batch_tokens") -> dict[str, torch.Tensor]:
        """Eval-mode, no-grad pass over this rank's `batch`: `{name: [B, R] float32}` in the batch's
        response order (0 at padding), on every pipeline stage."""
        for c in self.chunks:
            c.eval()
        mbs = self.micro_batches(batch, micro_batch_tokens, f"{self.name}.{budget_name}")

        def step_fn(mb):
            def collect(output):
                values = {k: v.detach().float() for k, v in output_fn(output, mb).items()}
                return output.new_zeros(()), {"index": mb.index, "values": values, "mb": mb}

            return collect

        from mrl.platform import stage

        with stage(f"{self.name} forward (eval)"):
            store = self._run(mbs, step_fn, forward_only=True)
        n, r = len(batch), batch.response_width
        names: list[str] = sorted(store[0]["values"]) if self.last_stage and store else []
        if self.pp > 1:
            box = [names]
            torch.distributed.broadcast_object_list(box, src=self.pp_last_rank, group=self.pp_group)
            names = box[0]
        out = {k: torch.zeros(n, r, dtype=torch.float32, device=self.device) for k in names}
        if self.last_stage:
            for rec in store:
                for k in names:
                    out[k].index_copy_(0, rec["index"].to(self.device), rec["mb"].to_padded(rec["values"][k]))
        if self.pp > 1:
            for k in names:
                out[k] = out[k].contiguous()
                torch.distributed.broadcast(out[k], src=self.pp_last_rank, group=self.pp_group)
        for c in self.chunks:
            c.train()
        return out

