"""The output layer at the response positions only (`mrl.models.head.at_rows`, the engine's
default) equals it over the whole packed row (`Engine(head_rows=False)`, the path before):
loss, every gradient and the eval log-probs, fp32 within 1e-6 relative, at DP2 (2 micro-batches
per rank; tied embeddings too), TP2, PP2 (3 micro-batches) and CP2; bf16 at DP2 reported
(bounded in the test). Same weights, same batch, same packing on both sides."""
import torch

import _engine_common as E
from _engine_common import C, SPEC, tm

from mrl.engine.objectives import PolicyObjective, actor_outputs

OBJ = PolicyObjective(loss="ppo", eps_low=0.2, eps_high=0.28, clip_c=3.0, entropy_coef=0.01)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) if b.numel() else 0.0


def chunk(params, dtype="float32", tied=False, state=None):
    """This rank's model with the full weights `params` (or those of the model `state`), in `dtype`."""
    from megatron.core import parallel_state as ps

    cfg = tm.tiny_gpt_config(SPEC, params_dtype=torch.bfloat16, bf16=True) if dtype == "bfloat16" else None
    model = tm.build_tiny_gpt(SPEC, config=cfg, share_embeddings=tied)
    if state is not None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(state[n])
    elif params is not None:
        E.load_full(model, params, ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
                    layer_offset=ps.get_pipeline_model_parallel_rank() * SPEC.num_layers // 2)
    return model


def compare(name, params, batch, micro_batches, **kw):
    """Both engines on the same weights and packing: loss, gradients, eval log-probs."""
    from megatron.core import parallel_state as ps

    from mrl.models.context_parallel import padded_length
    from mrl.engine import plan

    cp = ps.get_context_parallel_world_size()
    lengths = [padded_length(n, cp) if cp > 1 else n for n in batch.sequence_lengths.tolist()]
    budget = next(b for b in range(1, 10_000) if b * cp >= max(lengths) and len(plan(lengths, b * cp)) == micro_batches)
    state = None
    if kw.get("tied"):
        state = {n: p.detach().clone() for n, p in chunk(None, **kw).named_parameters()}
    out = {}
    for rows in (False, True):
        eng = E.actor_engine(None, chunks=[chunk(params, state=state, **kw)])
        eng.head_rows = rows
        m = eng.forward_backward(batch, OBJ, micro_batch_tokens=budget)
        assert m["micro_batches"] == micro_batches, m
        grads = {n: p.main_grad.detach().clone().float() for n, p in eng.chunks[0].module.named_parameters()}
        seen = []
        inner = actor_outputs(entropy=True)

        def outputs(logits, mb):   # the output's rows: the response positions only, or the whole row
            seen.append((logits.shape[1], mb.response_positions.numel() if rows else mb.row_tokens))
            return inner(logits, mb)

        lp = eng.forward_only(batch, outputs, micro_batch_tokens=budget)
        assert all(a == b for a, b in seen), (name, rows, seen)
        out[rows] = m["loss"], grads, lp
    (l0, g0, p0), (l1, g1, p1) = out[False], out[True]
    C.report(f"head_rows_{name}_loss", abs(l1 - l0) / abs(l0))
    C.report(f"head_rows_{name}_grads", max(rel(g1[n], g0[n]) for n in g0))
    C.report(f"head_rows_{name}_logprobs", max(rel(p1[k], p0[k]) for k in p0))


def main():
    ctx = C.up(tensor=1)   # DP = 2
    torch.manual_seed(42)
    ref = tm.build_tiny_gpt(SPEC)
    C.perturb_(ref, seed=43)
    params0 = C.full_params(ref)
    batch = E.with_old_logprobs(ref, E.synthetic_batch())
    mine = batch.dp_shard(ctx.dp_rank, 2)
    compare("dp2", params0, mine, 2)
    compare("dp2_tied", params0, mine, 2, tied=True)
    compare("dp2_bf16", params0, mine, 2, dtype="bfloat16")
    C.down()
    for name, layout, k in (("tp2", dict(tensor=2), 2), ("pp2", dict(pipeline=2), 3), ("cp2", dict(context=2), 2)):
        C.up(**layout)
        compare(name, params0, batch, k)
        C.down()


if __name__ == "__main__":
    C.main_guard(main)
