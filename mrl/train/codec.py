"""A step's rollouts as plain values and tensors, for checkpoints (the rollouts a separate
placement has queued for later steps are part of the data position)."""
from __future__ import annotations

import json

import torch

from mrl.rollout.types import Response
from mrl.train.produce import ShardRollout, StepRollout


def encode_rollout(r: StepRollout) -> dict:
    """A step's rollouts as plain values and tensors (checkpoints are read with
    `weights_only=True`: nothing in them may run code). Prompts are stored by dataset index."""
    shards = {}
    for d, s in r.shards.items():
        shards[str(d)] = {
            "items": [it.index for it in s.items],
            "lengths": torch.tensor([len(x.token_ids) for x in s.responses], dtype=torch.int64),
            "token_ids": torch.tensor([t for x in s.responses for t in x.token_ids], dtype=torch.int64),
            "logprobs": torch.tensor([v for x in s.responses for v in x.logprobs], dtype=torch.float32),
            "loss_mask": torch.tensor([v for x in s.responses for v in x.loss_mask], dtype=torch.int8),
            "finish": [x.finish_reason for x in s.responses],
            "info": [json.dumps(x.info) for x in s.responses],
            "prompt_index": [x.prompt_index for x in s.responses],
            "policy_version": [x.policy_version for x in s.responses],
            "scores": list(map(float, s.scores)),
            "stats": {k: float(v) for k, v in s.stats.items()},
            "version": s.version,
            "greedy_scores": None if s.greedy_scores is None else list(map(float, s.greedy_scores)),
            "routes": [x.routes for x in s.responses],   # MoE routes (int16 tensors) or None
        }
    return {"step": r.step, "version": r.version, "position": dict(r.position), "produce_s": r.produce_s,
            "finished_at": r.finished_at, "shards": shards, "carry": r.carry}


def decode_rollout(e: dict, dataset) -> StepRollout:
    """The inverse of `encode_rollout`, over the same dataset."""
    shards = {}
    for d, s in e["shards"].items():
        lengths = s["lengths"].tolist()
        ends = torch.tensor(lengths).cumsum(0).tolist()
        tok, lp, lm = s["token_ids"].tolist(), s["logprobs"].tolist(), s["loss_mask"].tolist()
        responses = [Response(prompt_index=pi, token_ids=tok[end - n:end], logprobs=lp[end - n:end], finish_reason=f,
                              loss_mask=lm[end - n:end], info=json.loads(info), policy_version=v, routes=rt)
                     for n, end, f, info, pi, v, rt in zip(lengths, ends, s["finish"], s["info"], s["prompt_index"],
                                                           s["policy_version"], s.get("routes") or [None] * len(lengths))]
        shards[int(d)] = ShardRollout(dp_rank=int(d), items=[dataset[i] for i in s["items"]], responses=responses,
                                      scores=list(s["scores"]), stats=dict(s["stats"]), version=int(s["version"]),
                                      greedy_scores=s.get("greedy_scores"))
    return StepRollout(step=int(e["step"]), version=int(e["version"]), shards=shards, position=dict(e["position"]),
                       produce_s=float(e["produce_s"]), finished_at=float(e["finished_at"]), carry=e.get("carry"))
