"""Online preference optimisation: pairs from each prompt's group of scored responses, and the
pairwise losses over sequence log-probs (docs/algorithms.md, "Online DPO").

- `preference_pairs`: `(chosen, rejected)` row indices per group: its best vs its worst response
  (`"best_worst"`), or every pair of its responses whose scores differ (`"margin"`), in both
  cases only where the score difference exceeds `margin`. Groups with no such pair are dropped
  (counted).
- `sequence_logps`: a response's log-probability, the sum of its token log-probs over the mask.
- `pair_loss`: the loss of each pair from the sequence log-probs of its two rows:
  `dpo` (Rafailov et al. 2023, arXiv:2305.18290), `-log sigmoid(beta * h)` with
  `h = (lp_c - ref_c) - (lp_r - ref_r)`; `ipo` (Azar et al. 2023, arXiv:2310.12036),
  `(h - 1 / (2 beta))^2` on the same `h`; `simpo` (Meng et al. 2024, arXiv:2405.14734),
  `-log sigmoid(beta * (lp_c / |c| - lp_r / |r|) - gamma)`, length-normalised, reference-free.
- `row_coefficients`: the mean pair loss over the global pair count, and its derivative with
  respect to each row's sequence log-prob. The trainer turns these into exact parameter
  gradients one micro-batch at a time (`mrl.engine.objectives.PairwiseObjective`): the loss is a
  function of per-row sums, so `dL/dtheta = sum_rows (dL/dS_row) dS_row/dtheta` and every row's
  term can be computed wherever its row lands.

Pure torch; no dependency on the rest of mrl.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["PAIRINGS", "DPO_LOSSES", "preference_pairs", "sequence_logps", "pair_loss", "implicit_rewards",
           "row_coefficients", "uses_reference"]

PAIRINGS = ("best_worst", "margin")
DPO_LOSSES = ("dpo", "ipo", "simpo")


def uses_reference(loss: str) -> bool:
    """Whether `loss` reads the reference model's log-probs (SimPO does not)."""
    return loss != "simpo"


def preference_pairs(scores: torch.Tensor, group_index: torch.Tensor, mode: str = "best_worst",
                     margin: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`(chosen [P], rejected [P], groups_dropped)` row indices into `scores` [B].

    `best_worst`: per group, the first row of its highest score against the first row of its
    lowest, when they differ by more than `margin`. `margin`: every ordered pair of rows of a
    group whose scores differ by more than `margin` (the higher one chosen). A group yielding no
    pair is dropped; groups appear in order of first appearance, pairs in row order."""
    if mode not in PAIRINGS:
        raise ValueError(f"unknown pairing {mode!r}")
    chosen: list[int] = []
    rejected: list[int] = []
    dropped = 0
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_index.tolist()):
        groups.setdefault(g, []).append(i)
    s = scores.tolist()
    for rows in groups.values():
        found = 0
        if mode == "best_worst":
            best = max(rows, key=lambda i: (s[i], -i))
            worst = min(rows, key=lambda i: (s[i], i))
            if s[best] - s[worst] > margin:
                chosen.append(best)
                rejected.append(worst)
                found = 1
        else:
            for a in rows:
                for b in rows:
                    if s[a] - s[b] > margin:
                        chosen.append(a)
                        rejected.append(b)
                        found += 1
        dropped += found == 0
    as_long = lambda x: torch.tensor(x, dtype=torch.long)   # noqa: E731
    return as_long(chosen), as_long(rejected), dropped


def sequence_logps(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[B]` float64 sums of the token log-probs `[B, R]` over the response mask (padding, even NaN,
    is 0). Summed in float64 so the result does not depend on the padded width (float32 sums
    change with the reduction's blocking)."""
    keep = mask > 0
    return torch.where(keep, logp, torch.zeros_like(logp)).double().sum(-1)


def implicit_rewards(seq: torch.Tensor, ref: Optional[torch.Tensor], lengths: torch.Tensor, loss: str,
                     beta: float) -> torch.Tensor:
    """`[B]` the implicit reward of each row: `beta * (lp - ref)` (dpo, ipo) or `beta * lp / |y|`
    (simpo)."""
    if loss == "simpo":
        return beta * seq / lengths.clamp(min=1).to(seq.dtype)
    return beta * (seq - ref)


def pair_loss(seq: torch.Tensor, ref: Optional[torch.Tensor], lengths: torch.Tensor, chosen: torch.Tensor,
              rejected: torch.Tensor, loss: str = "dpo", beta: float = 0.1, gamma: float = 0.0) -> torch.Tensor:
    """`[P]` the loss of each pair from the rows' sequence log-probs `seq` [B], the reference's
    `ref` [B] (None for simpo) and the response lengths `lengths` [B] (valid tokens)."""
    if loss == "dpo":
        h = (seq[chosen] - ref[chosen]) - (seq[rejected] - ref[rejected])
        return -F.logsigmoid(beta * h)
    if loss == "ipo":
        h = (seq[chosen] - ref[chosen]) - (seq[rejected] - ref[rejected])
        return (h - 1.0 / (2.0 * beta)) ** 2
    if loss == "simpo":
        n = lengths.clamp(min=1).to(seq.dtype)
        return -F.logsigmoid(beta * (seq[chosen] / n[chosen] - seq[rejected] / n[rejected]) - gamma)
    raise ValueError(f"unknown DPO loss {loss!r}")


def row_coefficients(seq: torch.Tensor, ref: Optional[torch.Tensor], lengths: torch.Tensor, chosen: torch.Tensor,
                     rejected: torch.Tensor, total_pairs: float, loss: str = "dpo", beta: float = 0.1,
                     gamma: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """`(coef [B], share [B], metrics)`, float64, for `L = sum_pairs pair_loss / total_pairs`.

    `coef[i] = dL/dseq[i]` (autograd through `pair_loss`, float64; 0 for rows in no pair, summed
    over the pairs of a row in several). `share[i]`: the loss of the pairs whose chosen row is `i`,
    over `total_pairs` (`share.sum()` is this call's part of `L`). `total_pairs` is the count over
    every data-parallel rank, so the parts of all ranks sum to the mean over all pairs. `metrics`
    (sums over this call's pairs, for the caller to divide by `total_pairs`): `loss`,
    `reward_margin` (implicit reward of chosen minus rejected), `reward_accuracy` (pairs with a
    positive margin), `chosen_logp`, `rejected_logp`."""
    s = seq.detach().double().requires_grad_(True)
    r = None if ref is None else ref.detach().double()
    per_pair = pair_loss(s, r, lengths, chosen, rejected, loss, beta, gamma)
    denom = max(float(total_pairs), 1.0)
    (coef,) = torch.autograd.grad(per_pair.sum() / denom, s, allow_unused=False) if len(chosen) else (
        torch.zeros_like(s),)
    per_pair = per_pair.detach()
    share = torch.zeros_like(s).index_add_(0, chosen, per_pair / denom).detach()
    with torch.no_grad():
        rew = implicit_rewards(s, r, lengths, loss, beta)
        gap = rew[chosen] - rew[rejected]
        metrics = {"loss": per_pair.sum(), "reward_margin": gap.sum(), "reward_accuracy": (gap > 0).double().sum(),
                   "chosen_logp": s[chosen].sum(), "rejected_logp": s[rejected].sum()}
    return coef, share, metrics
