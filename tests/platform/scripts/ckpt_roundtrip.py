"""dist_checkpointing on the cpu platform: save at TP=2, load at TP=1 (usage: ckpt_roundtrip.py DIR).

Loaded weights must equal the saved shards exactly, and the TP=1 logits must match the TP=2
logits of the saved model. Saving and loading use megatron's fully-parallel wrappers (each rank
writes / reads part of the replicated tensors and the ranks exchange the rest), as Megatron-LM
does by default. torch_dist saving starts a helper process, hence the __main__ guard.
"""
import sys

import torch

import _common as C
from mrl.models import tiny_model as tm

SPEC = tm.TinyGPTSpec(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=48, vocab_size=64, seq_length=8)
B = 2


def logits_of(model, gather):
    g = torch.Generator().manual_seed(51)
    ids = torch.randint(0, SPEC.vocab_size, (B, SPEC.seq_length), generator=g)
    with torch.no_grad():
        out = model(ids, tm.position_ids(B, SPEC.seq_length), None)
        return gather(out) if gather else out


def save_strategy():
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"))


def load_strategy(ckpt_dir):
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    return FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(ckpt_dir))


def main(ckpt_dir):
    from megatron.core import dist_checkpointing

    ctx = C.up(tensor=2)
    tp_rank = ctx.layout.tp_rank
    torch.manual_seed(52)
    model = tm.build_tiny_gpt(SPEC)
    C.perturb_(model, seed=53)  # same noise on both ranks keeps replicated weights (norms) identical
    saved = C.full_params(model)
    logits_tp2 = logits_of(model, tm.gather_vocab_parallel_logits)
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir, sharded_strategy=save_strategy())
    C.down()

    ctx = C.up(tensor=1)
    torch.manual_seed(54)  # a different init; the load must overwrite every weight
    model = tm.build_tiny_gpt(SPEC)
    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir, sharded_strategy=load_strategy(ckpt_dir))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")], missing
    worst = 0.0
    for name, p in model.named_parameters():
        worst = max(worst, C.check(f"loaded {name}", C.shard(name, p.detach(), 2, tp_rank,
                                                             num_query_groups=SPEC.num_query_groups),
                                   saved[name], tol=0.0))
    C.report("ckpt_weights_tp2_to_tp1", worst)
    C.report("ckpt_logits_tp2_vs_tp1", C.check("logits after load", logits_of(model, None), logits_tp2))
    C.down()


if __name__ == "__main__":
    C.main_guard(lambda: main(sys.argv[1]))
