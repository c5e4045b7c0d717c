"""Packed RoPE with the heads split over TP=2, on a QK-norm model (Qwen3): one packed row of mixed
lengths (1-token sequences included) through `PackedRopeSelfAttention` at TP=2 vs TP=1, logits
and every gradient. The QK-norm weights are replicated over TP and each rank's gradient covers its
own heads, so they are summed over the TP group before the comparison (as megatron's
finalize_model_grads does)."""
import torch

from _engine_common import C

from mrl.engine.packing import _thd_params
from mrl.models.megatron import build_gpt, gather_vocab_parallel_logits, transformer_config
from mrl.models.rope import PackedRopeSelfAttention
from mrl.platform.config import ParallelConfig

HF = dict(model_type="qwen3", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
          tie_word_embeddings=False)
LENGTHS = [7, 1, 12, 1, 3, 1, 9]
TOL = 1e-6


def model(tp: int):
    cfg = transformer_config(HF, dtype="float32", parallel=ParallelConfig(tensor=tp), device="cpu")
    m = build_gpt(HF, cfg, vocab_multiple=64)   # 128 rows at TP=1 and TP=2
    assert all(type(layer.self_attention) is PackedRopeSelfAttention for layer in m.decoder.layers)
    return m


def run(m, gather):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, HF["vocab_size"], (1, sum(LENGTHS)), generator=g)
    pos = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    out = m(tokens, pos, None, packed_seq_params=_thd_params(LENGTHS, "cpu"))
    out = gather(out) if gather else out
    out.square().mean().backward()
    return out.detach()


def main():
    C.up(tensor=1)
    torch.manual_seed(11)
    ref = model(1)
    C.perturb_(ref, seed=12)
    logits1 = run(ref, None)
    params1, grads1 = C.full_params(ref), C.full_grads(ref)
    C.down()

    ctx = C.up(tensor=2)
    torch.manual_seed(99)  # different init: every weight must come from the copy
    m = model(2)
    groups = HF["num_key_value_heads"]
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(C.shard(name, params1[name], 2, ctx.layout.tp_rank, num_query_groups=groups))
    logits2 = run(m, gather_vocab_parallel_logits)
    C.report("rope_tp2_qwen3_logits", C.check("logits", logits2, logits1, TOL))
    from megatron.core import parallel_state as ps

    worst = 0.0
    for name, p in m.named_parameters():
        if "q_layernorm" in name or "k_layernorm" in name:
            torch.distributed.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
        want = C.shard(name, grads1[name], 2, ctx.layout.tp_rank, num_query_groups=groups)
        worst = max(worst, C.check(f"grad {name}", p.grad, want, TOL))
    C.report("rope_tp2_qwen3_grads", worst)
    assert logits1.abs().max() > 0.1 and max(g.abs().max().item() for g in grads1.values()) > 1e-4
    C.down()


if __name__ == "__main__":
    main()
