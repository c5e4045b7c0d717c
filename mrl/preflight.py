"""`mrl preflight JOB`: bring a job's platform up on its real layout and run one training micro-step.

It checks, before GPU hours are spent, everything that can fail without data or a trained model:
the launcher environment and world size, process groups (with the job's timeouts), megatron's
TP/PP/CP/EP groups, the actor built from the model's architecture on this rank's shard (random
weights), one forward/backward of a full micro-batch (`actor.micro_batch_tokens`) through
megatron's pipeline schedule with the fused vocab-parallel log-prob/entropy kernels, and that the
gradient norm agrees across data-parallel replicas. Rank 0 prints one summary line.
"""
from __future__ import annotations

import math
import time

import torch


def _synthetic_batch(vocab: int, batch: int, seq: int, seed: int, device) -> dict:
    from mrl.models.megatron import position_ids

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    return {
        "tokens": tokens[:, :-1].contiguous().to(device),
        "labels": tokens[:, 1:].contiguous().to(device),
        "position_ids": position_ids(batch, seq, device),
        "attention_mask": None,
    }


def _grad_sq_norm(chunks) -> torch.Tensor:
    """Squared gradient norm of the whole model, identical on every rank when the model is.

    Dense parameters are summed over the model-parallel group (TP x PP), counting TP-replicated
    ones (norms) once; expert parameters over the expert group (expert TP x EP x PP).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    device = next(chunks[0].parameters()).device
    dense = torch.zeros((), dtype=torch.float64, device=device)
    expert = torch.zeros((), dtype=torch.float64, device=device)
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if p.grad is None:
                continue
            sq = p.grad.detach().double().pow(2).sum()
            if ".experts." in name:
                expert += sq
            elif param_is_not_tensor_parallel_duplicate(p):
                dense += sq
    torch.distributed.all_reduce(dense, group=ps.get_model_parallel_group())
    torch.distributed.all_reduce(expert, group=ps.get_expert_tensor_model_pipeline_parallel_group())
    return dense + expert


def run(spec) -> dict:
    """Run the preflight for a loaded job spec on this rank; returns the figures (rank 0 prints)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    import mrl_kernels
    from mrl import platform
    from mrl.models.megatron import build_model_chunks

    t_start = time.perf_counter()
    with platform.setup(spec.platform, spec.parallel, seed=spec.job.seed) as ctx:
        t_up = time.perf_counter()
        with platform.stage("model build"):
            hf, chunks = build_model_chunks(spec.model, spec.parallel, device=ctx.platform, recompute=spec.actor.recompute)
        params = sum(p.numel() for c in chunks for p in c.parameters())

        # The longest sequence the job allows; with CP, padded to a multiple of 2 x CP as megatron needs.
        step = 2 * spec.parallel.context if spec.parallel.context > 1 else 1
        seq = -(-(spec.data.max_prompt_tokens + spec.rollout.max_response_tokens) // step) * step
        micro_batch = max(1, (spec.actor.micro_batch_tokens * spec.parallel.context) // seq)
        microbatches = spec.parallel.pipeline
        tp_group = ps.get_tensor_model_parallel_group() if spec.parallel.tensor > 1 else None
        # The same data on every DP replica: identical weights must then give identical gradients.
        batches = [_synthetic_batch(hf["vocab_size"], micro_batch, seq, spec.job.seed + i, ctx.device)
                   for i in range(microbatches)]

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            logits = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])

            def loss_func(output):
                logp, entropy = mrl_kernels.logprob_entropy(
                    output.reshape(-1, output.shape[-1]), batch["labels"].reshape(-1),
                    spec.rollout.temperature, group=tp_group)
                loss = -logp.mean()
                return loss, {"loss": loss.detach().clone(), "entropy": entropy.detach().mean()}  # the schedule divides `loss` in place

            return logits, loss_func

        fb = get_forward_backward_func()
        iterators = [iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches)
        t0 = time.perf_counter()
        with platform.stage("forward/backward"):
            outputs = fb(forward_step_func=forward_step, data_iterator=iterators,
                         model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=microbatches,
                         seq_length=seq, micro_batch_size=micro_batch, forward_only=False)
        t_step = time.perf_counter() - t0

        with platform.stage("gradient check"):
            sq = _grad_sq_norm(chunks)
            norms = [torch.zeros_like(sq) for _ in range(ctx.world_size)]
            torch.distributed.all_gather(norms, sq)
            norms = [float(n.sqrt()) for n in norms]
            # only the last pipeline stage sees losses; average over the ranks that do
            local = [float(o["loss"]) for o in outputs]
            loss_sum = torch.tensor([sum(local) / max(1, len(local)), float(bool(local))], dtype=torch.float64,
                                    device=sq.device)
            torch.distributed.all_reduce(loss_sum)
            loss = float(loss_sum[0] / loss_sum[1])
        if not all(math.isfinite(n) and n > 0 for n in norms):
            raise RuntimeError(f"preflight: non-finite or zero gradient norms across ranks: {norms}")
        spread = (max(norms) - min(norms)) / max(norms)
        if spread > 1e-5:
            raise RuntimeError(f"preflight: gradient norms differ across ranks (relative spread {spread:.1e}): {norms}; "
                               "the model shards are inconsistent")
        peak = torch.cuda.max_memory_allocated() if ctx.platform == "cuda" else None
        result = dict(world=ctx.world_size, dp=ctx.dp, tp=spec.parallel.tensor, pp=spec.parallel.pipeline,
                      cp=spec.parallel.context, ep=spec.parallel.expert, params_per_rank=params,
                      micro_batch=micro_batch, seq=seq, microbatches=microbatches, step_s=t_step,
                      setup_s=t_up - t_start, grad_norms=norms, loss=loss, peak_bytes=peak, launcher=ctx.launcher,
                      backend=ctx.backend)
        if ctx.is_main:
            mem = f", peak {peak / 2**30:.2f} GiB" if peak is not None else ""
            print(f"preflight ok: {spec.job.name}: {ctx.platform}/{ctx.backend} via {ctx.launcher}, world {ctx.world_size} = "
                  f"DP {ctx.dp} x TP {spec.parallel.tensor} x PP {spec.parallel.pipeline} x CP {spec.parallel.context}"
                  f"{f' (EP {spec.parallel.expert})' if spec.parallel.expert > 1 else ''}; "
                  f"{params / 1e6:.2f}M params/rank; {microbatches} micro-batch(es) of {micro_batch} x {seq} tokens: "
                  f"forward/backward {t_step:.2f} s{mem}; loss {loss:.4f}; grad norm {norms[0]:.4f} "
                  f"(equal on all ranks within {spread:.0e}); set-up {t_up - t_start:.1f} s", flush=True)
        return result
