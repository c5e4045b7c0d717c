"""The critic (a `build_role_model("critic", ...)` value head on tiny-qwen2) through the engine.

Reference: one naive call over the whole mini-batch on a bare TP=1 critic (unpacked sequences,
positions from 0, clipped token-mean value loss). Compared with it:
- the packed values pass (`forward_only` + `values_output`) = the unpacked forward's values;
- DP=2 with 1, 2 and 4 micro-batches per rank: loss and every gradient;
- TP=2 (DP=1): loss and every gradient (the value head is replicated over TP);
- CP=2 (DP=1): the values pass, loss and every gradient (values gathered over CP).
"""
import torch

import _engine_common as E
from _engine_common import C

from mrl.batch import Batch
from mrl.engine import Engine
from mrl.engine.objectives import ValueObjective, values_output
from mrl.models.facts import BUILTIN_PRESETS
from mrl.models.megatron import complete_hf_config, parallel_from_state
from mrl.models.roles import build_role_model

HF = complete_hf_config(dict(BUILTIN_PRESETS["tiny-qwen2"]))  # QKV bias, tied embeddings (the critic unties)
OBJ = ValueObjective(clip_eps=0.2)
TOL = 1e-6


def critic():
    return build_role_model("critic", HF, parallel_from_state(), dtype="float32", device="cpu")


def shard(name: str, full: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """TP shard of a full critic parameter: the value head is replicated, QKV biases follow the
    QKV weight's query-group layout, everything else the tiny GPT's rules."""
    if tp == 1 or name == "output_layer.weight":
        return full
    if name.endswith("linear_qkv.bias"):
        return full.view(HF["num_key_value_heads"], -1).chunk(tp, dim=0)[tp_rank].reshape(-1)
    return C.shard(name, full, tp, tp_rank, num_query_groups=HF["num_key_value_heads"])


def critic_engine(params_full) -> Engine:
    from megatron.core import parallel_state as ps

    from mrl.optim import build_optimizer, wrap_ddp
    from mrl.optim.config import OptimConfig

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    model = critic()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(shard(n, params_full[n], tp, tp_rank))
    ddp = wrap_ddp([model], distributed_optimizer=False)
    opt = build_optimizer(ddp, OptimConfig(lr=1e-3), distributed_optimizer=False, section="critic")
    return Engine(ddp, optimizer=opt, name="critic")


def naive_values(model, batch: Batch) -> torch.Tensor:
    """[B, R] values from the `[s, 1]` value head output."""
    def read(v, pos, labels):
        assert v.dim() == 2 and v.shape[1] == 1, v.shape
        return v[pos, 0].float()

    return E.naive_per_token(model, batch, read)


def grads_of(engine):
    return {n: p.main_grad.detach().clone() for n, p in engine.chunks[0].module.named_parameters()}


def main():
    from mrl.algos import losses

    ctx = C.up(tensor=1)  # DP = 2
    torch.manual_seed(42)
    ref = critic()
    C.perturb_(ref, seed=43)
    params0 = C.full_params(ref)
    assert params0["output_layer.weight"].shape == (1, HF["hidden_size"])
    assert "embedding.word_embeddings.weight" in params0 and len(params0) == len(dict(ref.named_parameters()))
    g = torch.Generator().manual_seed(11)
    batch = E.synthetic_batch()
    with torch.no_grad():
        v0 = naive_values(ref, batch)
    old = v0 + 0.3 * torch.randn(v0.shape, generator=g)  # the critic's values before the update, perturbed
    batch = batch.add(values=old, returns=v0 + torch.randn(v0.shape, generator=g))
    ref.zero_grad(set_to_none=True)
    v = naive_values(ref, batch)
    want_loss, _ = losses.value(v, batch["values"], batch["returns"], batch["response_mask"], OBJ.clip_eps, "token-mean")
    want_loss.backward()
    want = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    assert all(w.abs().max() > 0 for w in want.values()), "every critic parameter must get a gradient"
    want_loss = float(want_loss)
    halves = [batch.dp_shard(r, 2) for r in range(2)]
    mine = halves[ctx.dp_rank]
    lengths = [h.sequence_lengths.tolist() for h in halves]

    eng = critic_engine(params0)
    got = eng.forward_only(mine, values_output(), micro_batch_tokens=E.budget_for(lengths, 2))["values"]
    with torch.no_grad():
        exp = naive_values(ref, mine)
    C.report("critic_packed_vs_unpacked_values", C.check("packed values", got, exp, tol=1e-5))

    for k in (1, 2, 4):
        eng = critic_engine(params0)
        m = eng.forward_backward(mine, OBJ, micro_batch_tokens=E.budget_for(lengths, k))
        assert m["micro_batches"] == k and 0 < m["vf_clipfrac"] < 1, m  # both branches of the clip engage
        worst = max(C.check(f"critic grad {n} (k={k})", g_, want[n], tol=TOL) for n, g_ in grads_of(eng).items())
        C.report(f"critic_dp2_mb{k}_grads", worst)
        C.report(f"critic_dp2_mb{k}_loss", abs(m["loss"] - want_loss))
    C.down()

    ctx = C.up(tensor=2)  # DP = 1
    eng = critic_engine(params0)
    m = eng.forward_backward(batch, OBJ, micro_batch_tokens=E.budget_for([batch.sequence_lengths.tolist()], 2))
    tp_rank = ctx.layout.tp_rank
    worst = max(C.check(f"critic grad {n} (tp2)", g_, shard(n, want[n], 2, tp_rank), tol=TOL)
                for n, g_ in grads_of(eng).items())
    C.report("critic_tp2_grads", worst)
    C.report("critic_tp2_loss", abs(m["loss"] - want_loss))
    C.down()

    from cp_equivalence import budget_for   # per-rank budgets of 2N-chunked sequences

    C.up(context=2)  # DP = 1
    eng = critic_engine(params0)
    got = eng.forward_only(batch, values_output(), micro_batch_tokens=budget_for(batch, 2))["values"]
    with torch.no_grad():
        exp = naive_values(ref, batch)
    C.report("critic_cp2_values", C.check("cp2 values", got, exp, tol=1e-5))
    m = eng.forward_backward(batch, OBJ, micro_batch_tokens=budget_for(batch, 2))
    assert m["micro_batches"] == 2, m
    C.report("critic_cp2_grads", max(C.check(f"critic grad {n} (cp2)", g_, want[n], tol=TOL)
                                     for n, g_ in grads_of(eng).items()))
    C.report("critic_cp2_loss", abs(m["loss"] - want_loss))
    C.down()


if __name__ == "__main__":
    C.main_guard(main)
