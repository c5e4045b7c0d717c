"""To a batch: a trainer rank's step rollouts (`mrl.train.produce.ShardRollout`) as one `Batch`,
with the rollout's metrics and sample table.

The batch holds the token ids, group indices, `rewards` (after overlong shaping), the engine's
`rollout_logprobs` and, for an MoE model whose engine returned them, the rollout's routes
(`rollout_*_routes`, which the actor passes replay: `mrl.train.step`, `actor.moe.routing_replay`).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from mrl.batch import Batch
from mrl.rollout.tools import tool_metrics
from mrl.train.parts import Run


def to_batch(run: Run, shard, step: int) -> tuple[Batch, dict[str, float], Optional[dict]]:
    """A trainer rank's `Batch` for `step` from its shard: token ids, group indices, `rewards`
    (after overlong shaping), `rollout_logprobs`, and the step's rollout metrics; plus a sample
    table on the main rank when the step logs one (else None)."""
    spec = run.spec
    alg = spec.algorithm
    n = spec.rollout.responses_per_prompt
    kept_items, kept_resp, kept_scores = shard.items, shard.responses, shard.scores
    prompts = [list(it.token_ids) for it in kept_items for _ in range(n)]   # one per response
    batch = Batch.from_sequences(prompts,
                                 [r.token_ids for r in kept_resp],
                                 group_index=[i for i in range(len(kept_items)) for _ in range(n)],
                                 loss_masks=[r.loss_mask for r in kept_resp],
                                 pad_id=run.tokenizer.pad_token_id or 0)
    width = batch.response_width
    rollout_lp = torch.zeros(len(kept_resp), width)
    for i, r in enumerate(kept_resp):
        rollout_lp[i, :len(r.logprobs)] = torch.tensor(r.logprobs, dtype=torch.float32)
    truncated = torch.tensor([r.finish_reason == "length" for r in kept_resp])
    scores = torch.tensor(kept_scores, dtype=torch.float32)
    raw_scores = scores.clone()
    if alg.overlong.enable:
        from mrl.algos.dapo import overlong_penalty

        scores = scores + overlong_penalty(batch["response_lengths"], spec.rollout.max_response_tokens,
                                           alg.overlong.buffer_tokens, alg.overlong.penalty_factor)
    mask = batch["response_mask"]
    if alg.overlong.enable and alg.overlong.mask_truncated:
        mask = mask * (~truncated).long().unsqueeze(1)
    batch = Batch({**batch.tensors, "response_mask": mask}, {"prompt_item": [it for it in kept_items for _ in range(n)]})
    batch = batch.add(rewards=scores, raw_scores=raw_scores, rollout_logprobs=rollout_lp, truncated=truncated.long())
    if alg.gdpo_reward_keys:
        batch = batch.add(reward_components=torch.tensor([r.info["reward_components"] for r in kept_resp],
                                                         dtype=torch.float32).view(len(kept_resp), -1))
    batch = batch.add(**rollout_routes(kept_resp, prompts, batch))
    if shard.greedy_scores is not None:   # ReMax: the baseline produced with the group
        batch = batch.add(greedy_scores=torch.tensor(shard.greedy_scores, dtype=torch.float32).repeat_interleave(n))
    metrics = {
        "reward/mean": float(raw_scores.mean()),
        "reward/shaped_mean": float(scores.mean()),
        "response/length_mean": float(batch["response_lengths"].float().mean()),
        "response/truncated_fraction": float(truncated.float().mean()),
        **{k: v for k, v in shard.stats.items() if not math.isnan(v)},
        **tool_metrics(kept_resp),   # multi-turn: tools/calls, tools/errors_*, tools/truncated
    }
    rows = None
    from mrl.tracking.samples import sample_rows, wants_samples

    if run.ctx.is_main and wants_samples(spec.trainer.log_samples_every, step, run.total_steps):
        rows = sample_rows(step, kept_items, kept_resp, raw_scores.tolist(), n, run.tokenizer)
    return batch, metrics, rows


def rollout_routes(responses, prompts: list[list[int]], batch: Batch) -> dict[str, torch.Tensor]:
    """`rollout_prompt_routes [B, P, L, k]` (left-padded) and `rollout_response_routes [B, R, L, k]`
    (right-padded) from each response's `routes` (`[prompt + response tokens, L, k]`), -1 at
    padding; `{}` when a response has none (a dense model, an engine that does not return them)."""
    if not responses or any(r.routes is None for r in responses):
        return {}
    L, k = responses[0].routes.shape[1:]
    P, R = batch["prompt_ids"].shape[1], batch.response_width
    prompt = torch.full((len(responses), P, L, k), -1, dtype=responses[0].routes.dtype)
    response = torch.full((len(responses), R, L, k), -1, dtype=responses[0].routes.dtype)
    for i, (r, p) in enumerate(zip(responses, prompts)):
        if r.routes.shape[0] != len(p) + len(r.token_ids):
            raise RuntimeError(f"response {i}: routes for {r.routes.shape[0]} tokens, but prompt + response "
                               f"have {len(p) + len(r.token_ids)}")
        prompt[i, P - len(p):] = r.routes[:len(p)]
        response[i, :len(r.token_ids)] = r.routes[len(p):]
    return {"rollout_prompt_routes": prompt, "rollout_response_routes": response}
