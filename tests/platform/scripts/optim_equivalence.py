"""DDP + DistributedOptimizer on the cpu platform: one step at TP=1 x DP=2 and at TP=2 x DP=1.

A third run uses megatron's plain fp32 optimizer at TP=2. Both layouts see the same global batch (DP=2 splits it, TP=2 ranks share it) and the same
weights; the reported grad norm, the clipped Adam update and the parameters after the step must
agree. Exercises DDP's grad buffers and reduce-scatter, the distributed optimizer's sharded
fp32 main params and param all-gather, and `clip_grads` (clipping is forced by a small max norm).
"""
import torch

import _common as C
from mrl.models import tiny_model as tm

SPEC = tm.TinyGPTSpec(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=48, vocab_size=64, seq_length=8)
GLOBAL_B = 4
# The distributed optimizer supports Adam only. A large eps keeps Adam's first step smooth in the
# gradient (|d update / d grad| <= LR / eps), so layout round-off cannot flip an update's sign.
LR, CLIP = 1e-2, 0.1


def global_batch():
    g = torch.Generator().manual_seed(41)
    ids = torch.randint(0, SPEC.vocab_size, (GLOBAL_B, SPEC.seq_length), generator=g)
    labels = torch.randint(0, SPEC.vocab_size, (GLOBAL_B, SPEC.seq_length), generator=g)
    return ids, labels


def step(params_full, tp, dp_rank, dp, distributed=True):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core import parallel_state as ps

    model = tm.build_tiny_gpt(SPEC)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(C.shard(name, params_full[name], tp, ps.get_tensor_model_parallel_rank(),
                            num_query_groups=SPEC.num_query_groups))
    ddp = DistributedDataParallel(
        config=model.config,
        # overlap_grad_reduce: grads reduce asynchronously from backward hooks (a "CUDA stream" on cpu).
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                                 use_distributed_optimizer=distributed, bucket_size=4096),
        module=model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=LR, adam_eps=1e-4, weight_decay=0.0, clip_grad=CLIP,
                        use_distributed_optimizer=distributed, bf16=False, fp16=False, params_dtype=torch.float32),
        [ddp])
    ddp.zero_grad_buffer()
    opt.zero_grad()
    ids, labels = global_batch()
    per = GLOBAL_B // dp
    ids, labels = ids[dp_rank * per:(dp_rank + 1) * per], labels[dp_rank * per:(dp_rank + 1) * per]
    loss = ddp(ids, tm.position_ids(per, SPEC.seq_length), None,
               labels=labels)
    loss.mean().backward()
    ddp.finish_grad_sync()
    ok, grad_norm, _ = opt.step()
    assert ok
    return grad_norm, {n: p.detach().clone() for n, p in model.named_parameters()}


def main():
    ctx = C.up(tensor=1)
    torch.manual_seed(42)
    ref = tm.build_tiny_gpt(SPEC)
    C.perturb_(ref, seed=43)
    params0 = C.full_params(ref)
    norm_a, after_a = step(params0, 1, ctx.dp_rank, ctx.dp)
    C.down()

    ctx = C.up(tensor=2)
    norm_b, after_b = step(params0, 2, ctx.dp_rank, ctx.dp)
    # Same layout with megatron's plain (non-distributed) fp32 optimizer.
    norm_c, after_c = step(params0, 2, ctx.dp_rank, ctx.dp, distributed=False)
    tp_rank = ctx.layout.tp_rank
    print(f"rank {ctx.rank}: grad norm TP1xDP2 {norm_a!r}, TP2xDP1 {norm_b!r}", flush=True)
    C.report("optim_grad_norm", C.check("grad norm", torch.tensor(norm_b), torch.tensor(norm_a)))
    assert norm_a > CLIP, f"grad norm {norm_a} must exceed clip_grad so clipping runs"
    worst, moved = 0.0, 0.0
    for name, p in after_b.items():
        want = C.shard(name, after_a[name], 2, tp_rank, num_query_groups=SPEC.num_query_groups)
        worst = max(worst, C.check(f"param {name} after step", p, want))
        moved = max(moved, (p - C.shard(name, params0[name], 2, tp_rank,
                                        num_query_groups=SPEC.num_query_groups)).abs().max().item())
    assert moved > 1e-4, "the step must change the parameters"
    C.report("optim_params_after_step", worst)
    plain = C.check("grad norm, plain optimizer", torch.tensor(norm_c), torch.tensor(norm_a))
    for name, p in after_c.items():
        plain = max(plain, C.check(f"param {name} after plain step", p, after_b[name]))
    C.report("optim_plain_vs_distributed", plain)
    C.down()


if __name__ == "__main__":
    C.main_guard(main)
