"""The SFT loss: token-mean cross-entropy over the trained (assistant) tokens of a whole step.

`sum over trained tokens of -log p(token | context) / N`, N = trained tokens of the step on all
data-parallel ranks, so the gradient does not depend on how the step is split into micro-batches
or ranks (the engine's global-count scaling, `mrl.engine.engine`). Log-probs come from the
vocabulary-parallel kernels (`mrl_kernels`): the logits are never gathered over TP, and
Megatron's vocabulary padding is masked, so the loss equals a plain `transformers` cross-entropy.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from mrl.engine.engine import Totals
from mrl.engine.packing import MicroBatch


@dataclasses.dataclass(frozen=True)
class SFTObjective:
    """The engine `LossFn` of `mrl sft`."""

    vocab_size: Optional[int] = None   # the HF vocabulary: Megatron's padding beyond it is masked
    kernels: str = "auto"

    def __call__(self, logits: torch.Tensor, mb: MicroBatch, totals: Totals):
        from mrl.algos import losses
        from mrl.engine.objectives import response_logprobs

        logp, _ = response_logprobs(logits, mb, 1.0, vocab_size=self.vocab_size, kernels=self.kernels)
        nll = -mb.to_padded(logp)
        mask = mb.batch["response_mask"]
        loss = losses.aggregate(nll, mask, "token-mean", None, totals.tokens, global_sequences=totals.sequences)
        valid = mask > 0
        return loss, {"nll": (nll.detach() * valid).sum() / valid.sum().clamp(min=1)}


def token_nll_sum(engine, batch, *, micro_batch_tokens: int, vocab_size: int, kernels: str = "auto") -> tuple[float, float]:
    """(sum of -log p over trained tokens, trained tokens) of `batch` on all DP ranks (eval mode)."""
    from mrl.engine.objectives import actor_outputs

    out = engine.forward_only(batch, actor_outputs(1.0, vocab_size=vocab_size, kernels=kernels),
                              micro_batch_tokens=micro_batch_tokens, budget_name="micro_batch_tokens")
    mask = batch["response_mask"].to(out["logprobs"].device) > 0
    t = torch.stack([-(out["logprobs"] * mask).sum().double(), mask.sum().double()])
    if engine.dp > 1:
        torch.distributed.all_reduce(t, group=engine.dp_group)
    return float(t[0]), float(t[1])
