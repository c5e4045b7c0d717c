"""Shared pieces of the engine's multi-process test scripts: a tiny actor, a synthetic rollout
batch, and a naive single-call reference (unpacked, one forward per sequence, torch log-softmax).

The reference model runs megatron's own unfused attention with a dense causal mask
(`attention="reference"`), so every engine comparison is also the packed attention backend
(thd, `sdpa` on cpu) against the dense-mask path."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "platform" / "scripts"))
import _common as C  # noqa: E402  (platform test helpers: up/down/shard/perturb/report/check)

from mrl.batch import Batch  # noqa: E402
from mrl.models import tiny_model as tm  # noqa: E402

SPEC = tm.TinyGPTSpec(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=48, vocab_size=64, seq_length=64)


def synthetic_batch(prompts: int = 4, per_prompt: int = 2, seed: int = 7) -> Batch:
    """Random prompts/responses of varied lengths, a loss mask with a masked 'tool' span, random
    per-response advantages; old log-probs are filled in later from the model."""
    g = torch.Generator().manual_seed(seed)
    ps_, rs, masks, groups = [], [], [], []
    for p in range(prompts):
        prompt = torch.randint(0, SPEC.vocab_size, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(per_prompt):
            n = int(torch.randint(1, 12, (1,), generator=g))
            resp = torch.randint(0, SPEC.vocab_size, (n,), generator=g).tolist()
            m = [1] * n
            if n > 5:
                m[2:4] = [0, 0]  # a tool output inside the response
            ps_.append(prompt)
            rs.append(resp)
            masks.append(m)
            groups.append(p)
    b = Batch.from_sequences(ps_, rs, group_index=groups, loss_masks=masks)
    return b.add(advantages=torch.randn(len(b), generator=g))


def naive_per_token(model, batch: Batch, read) -> torch.Tensor:
    """[B, R] of `read(output[0], positions, labels)`: one unpacked forward per response with
    positions from 0, read at the state before each response token."""
    out = torch.zeros(len(batch), batch.response_width)
    p_w = batch["prompt_ids"].shape[1]
    for i in range(len(batch)):
        p, r = int(batch.prompt_lengths[i]), int(batch["response_lengths"][i])
        seq = torch.cat([batch["prompt_ids"][i, p_w - p:], batch["response_ids"][i, :r]]).unsqueeze(0)
        s = seq.shape[1]
        dense = getattr(model, "mrl_attention", None) == "reference"
        output = model(seq, tm.position_ids(1, s), tm.block_causal_mask([s]) if dense else None)
        values = read(output[0], torch.arange(p - 1, p - 1 + r), batch["response_ids"][i, :r])
        out = out.index_put((torch.full((r,), i), torch.arange(r)), values)
    return out


def naive_logprobs(model, batch: Batch) -> torch.Tensor:
    """[B, R] log-probs of the response tokens."""
    return naive_per_token(model, batch, lambda logits, pos, labels: torch.log_softmax(logits.float(), -1)[pos, labels])


def with_old_logprobs(model, batch: Batch, seed: int = 9) -> Batch:
    """Old log-probs = the model's own plus noise, so ratios differ from 1 and clips engage."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        lp = naive_logprobs(model, batch)
    return batch.add(old_logprobs=lp + 0.3 * torch.randn(lp.shape, generator=g))


def reference_setup(**batch_kw):
    """The seeded, perturbed reference model, its full parameters and a batch with old log-probs."""
    torch.manual_seed(42)
    ref = tm.build_tiny_gpt(SPEC, attention="reference")
    C.perturb_(ref, seed=43)
    return ref, C.full_params(ref), with_old_logprobs(ref, synthetic_batch(**batch_kw))


def naive_loss_and_grads(model, batch: Batch, eps=(0.2, 0.28), clip_c=3.0):
    """One call over the whole mini-batch: PPO per token, token-mean; returns (loss, {name: grad})."""
    from mrl.algos import losses

    model.zero_grad(set_to_none=True)
    lp = naive_logprobs(model, batch)
    per_token, _ = losses.ppo(lp, batch["old_logprobs"], batch["advantages"], batch["response_mask"], *eps, clip_c)
    loss = losses.aggregate(per_token, batch["response_mask"], "token-mean")
    loss.backward()
    return float(loss), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def actor_engine(params_full, *, distributed: bool = False, lr: float = 1e-2, nonfinite: str = "stop",
                 total_steps: int = 10, warmup: int = 0, clip: float = 0.0, vp_stage=None, chunks=None):
    """An actor `Engine` on the current layout with the full (TP=1) weights `params_full`."""
    from megatron.core import parallel_state as ps

    from mrl.engine import Engine
    from mrl.optim import build_optimizer, build_scheduler, wrap_ddp
    from mrl.optim.config import OptimConfig, ScheduleConfig

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    model = chunks[0] if chunks else tm.build_tiny_gpt(SPEC)
    if params_full is not None:
        load_full(model, params_full, tp, tp_rank)
    ddp = wrap_ddp([model], distributed_optimizer=distributed)
    optim = OptimConfig(lr=lr, weight_decay=0.01, eps=1e-4, grad_clip=clip, nonfinite=nonfinite)
    opt = build_optimizer(ddp, optim, distributed_optimizer=distributed)
    sched = build_scheduler(opt, optim, ScheduleConfig(warmup_steps=warmup, decay="cosine"), total_steps)
    return Engine(ddp, optimizer=opt, scheduler=sched, grad_clip=clip, nonfinite=nonfinite)


def load_full(model, params_full, tp, tp_rank, layer_offset: int = 0):
    """Copy full weights into this rank's shard (layer names shifted by `layer_offset` for PP)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(C.shard(name, params_full[_global_name(name, layer_offset)], tp, tp_rank,
                            num_query_groups=SPEC.num_query_groups))


def _global_name(name: str, offset: int) -> str:
    if offset and name.startswith("decoder.layers."):
        parts = name.split(".")
        parts[2] = str(int(parts[2]) + offset)
        return ".".join(parts)
    return name


def budget_for(lengths_per_rank: list[list[int]], count: int) -> int:
    """A token budget under which the busiest rank packs into exactly `count` micro-batches."""
    from mrl.engine import plan

    for b in range(max(max(x) for x in lengths_per_rank), 10_000):
        if max(len(plan(x, b)) for x in lengths_per_rank) == count:
            return b
    raise ValueError(f"no budget gives {count} micro-batches")
