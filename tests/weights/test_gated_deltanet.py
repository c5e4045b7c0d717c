"""Qwen3-Next / Qwen3.5 hybrids by hand and against transformers (world 1): the gated delta rule's
torch twins (a hand-computed case, the chunked twin against the recurrence in values and gradients,
both against transformers' chunked and recurrent references, packed rows equal to their sequences
one by one, what autograd keeps per chunk), the packed causal conv, the weight transforms at TP 1 and 2,
and whole tiny models: Megatron logits against transformers' and packed rows against unpacked ones.
The TP=2 / PP=2 / EP=2 layouts run in the shared launch (test_weights_layouts.py)."""
from __future__ import annotations

import functools
import json
import math

import pytest
import torch
import torch.nn.functional as F

from mrl.platform.delta_rule import CHUNK, chunked_twin, l2norm, recurrent_twin
from tests.weights.archs import make_hf_model, probe_tokens
from tests.weights.test_weights import _Mem

HYBRIDS = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


TWINS = {"recurrent": recurrent_twin, "chunked": chunked_twin,
         "chunked C=1": functools.partial(chunked_twin, chunk=1)}   # one token per chunk: the state carry alone


@pytest.mark.parametrize("twin", TWINS)
def test_delta_rule_by_hand(twin):
    """One head, d_k = d_v = 1, q = k = 1 (unit after the L2 norm), v = 2 then 4: with beta 1 the
    state stores 2, then recalls 2 and writes 4 (outputs 2, 4); with beta 0.5 it stores 1, then
    adds (4 - 1) x 0.5 (1, 2.5); a decay exp(g) = 0.5 before the second token halves the 1 first
    (1, 0.5 + (4 - 0.5) x 0.5 = 2.25)."""
    rule = TWINS[twin]
    one = torch.ones(2, 1, 1)
    v = torch.tensor([2.0, 4.0]).view(2, 1, 1)
    cu = torch.tensor([0, 2])
    zero, half = torch.zeros(2, 1), torch.full((2, 1), 0.5)
    assert rule(one, one, v, zero, torch.ones(2, 1), cu).flatten().tolist() == pytest.approx([2, 4], rel=1e-5)
    assert rule(one, one, v, zero, half, cu).flatten().tolist() == pytest.approx([1, 2.5], rel=1e-5)
    g = torch.tensor([[0.0], [math.log(0.5)]])
    assert rule(one, one, v, g, half, cu).flatten().tolist() == pytest.approx([1, 2.25], rel=1e-5)
    # two sequences of one token each: the second starts from a zero state again
    assert rule(one, one, v, zero, half, torch.tensor([0, 1, 2])).flatten().tolist() == pytest.approx([1, 2], rel=1e-5)


def _random_rule_inputs(total: int, seed: int = 0, kh: int = 2, vh: int = 4, d: int = 16, dv: int | None = None,
                        decay_scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(total, kh, d, generator=g) for _ in range(2))
    v = torch.randn(total, vh, dv or d, generator=g)
    decay = -torch.rand(total, vh, generator=g) * decay_scale        # g <= 0
    beta = torch.rand(total, vh, generator=g)
    return q, k, v, decay, beta


@pytest.mark.parametrize("twin", ["recurrent", "chunked"])
@pytest.mark.parametrize("reference", ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"])
def test_twin_equals_transformers_references(reference, twin):
    """Sequences of 70 (across the chunked form's 64-token chunk), 5 and 1 tokens, 2 key heads
    serving 4 value heads: each twin on the packed row equals transformers' torch references run
    on each sequence alone, within 1e-5 in float32 (the forms sum in other orders)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as ref

    lengths = [70, 5, 1]
    q, k, v, g, beta = _random_rule_inputs(sum(lengths))
    cu = torch.tensor([0, 70, 75, 76])
    got = TWINS[twin](q, k, v, g, beta, cu)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        want, _ = getattr(ref, reference)(*(x[a:b][None] for x in (q, k, v, g, beta)), use_qk_l2norm_in_kernel=True)
        assert (got[a:b] - want[0]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("twin", ["recurrent", "chunked"])
def test_twin_packed_row_equals_sequences_one_by_one(twin):
    """The state restarts at each sequence: a row of four sequences (one across two chunks) gives
    each sequence's outputs computed alone, bit for bit, and bf16 inputs are computed in float32
    and rounded once (the float32 result on the same bf16 values, rounded to bf16, exactly)."""
    rule = TWINS[twin]
    lengths = [9, 3, 70, 6]
    q, k, v, g, beta = _random_rule_inputs(sum(lengths), seed=1)
    cu = torch.tensor([0, 9, 12, 82, 88])
    row = rule(q, k, v, g, beta, cu)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], torch.tensor([0, b - a]))
        assert torch.equal(row[a:b], alone)
    low = rule(*(x.bfloat16() for x in (q, k, v)), g, beta.bfloat16(), cu)
    assert low.dtype == torch.bfloat16
    assert torch.equal(low, rule(*(x.bfloat16().float() for x in (q, k, v)), g, beta.bfloat16().float(), cu).bfloat16())
    assert torch.allclose(l2norm(q).norm(dim=-1), torch.ones(q.shape[:2]), atol=1e-5)


def test_chunk_layout_by_hand():
    """Sequences of 3 and 2 tokens in chunks of 2, longest first and position-major: chunk 0 of
    both ([0, 1], [3, 4]), then chunk 1 of the first ([2] and a padding slot)."""
    from mrl.platform.delta_rule import _chunk_layout

    index, valid, counts = _chunk_layout([0, 3, 5], 2)
    assert counts == [2, 1]
    assert index.tolist() == [[0, 1], [3, 4], [2, 0]]
    assert valid.tolist() == [[True, True], [True, True], [True, False]]
    index, valid, counts = _chunk_layout([0, 2, 2, 7], 4)      # the empty sequence has no chunk
    assert counts == [2, 1] and index.tolist() == [[2, 3, 4, 5], [0, 1, 0, 0], [6, 0, 0, 0]]


def _run_with_grads(rule, inputs, cu, weight):
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    out = rule(*xs, cu)
    (out.float() * weight).sum().backward()
    return out.detach(), [x.grad for x in xs]


CHUNKED_CASES = {
    "one sequence shorter than C": dict(lengths=[50]),
    "70 tokens: two chunks": dict(lengths=[70]),
    "130 tokens: three chunks": dict(lengths=[130]),
    "packed mixed lengths": dict(lengths=[70, 1, 130, 5, 64, 9]),
    "strongly negative g": dict(lengths=[130, 7], decay_scale=30.0),
    "no grouping, d_k != d_v": dict(lengths=[100, 30], kh=4, dv=8),
}


@pytest.mark.parametrize("case", CHUNKED_CASES)
def test_chunked_twin_equals_the_recurrence(case):
    """The chunked form against the recurrence read literally (2 key heads serving 4 value heads
    unless stated): outputs within 1e-5 in float32, gradients w.r.t. q, k, v, g and beta within
    1e-5 of the largest (relative), across chunk boundaries, packed sequences, length 1, a length
    that is a multiple of C, and decays down to exp(-30) per token."""
    spec = dict(CHUNKED_CASES[case])
    lengths = spec.pop("lengths")
    inputs = _random_rule_inputs(sum(lengths), seed=5, **spec)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    weight = torch.randn(inputs[2].shape, generator=torch.Generator().manual_seed(6))
    got, got_grads = _run_with_grads(chunked_twin, inputs, cu, weight)
    want, want_grads = _run_with_grads(recurrent_twin, inputs, cu, weight)
    assert (got - want).abs().max().item() <= 1e-5
    for name, a, b in zip("q k v g beta".split(), got_grads, want_grads):
        assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item(), name


def test_chunked_twin_keeps_its_precision_after_a_run_of_strong_decay():
    """20 tokens of g = -200 then g near 0 within one chunk: the cumulative gate reaches -4000,
    where float32 resolves 2.4e-4, so decays taken as differences of cumulative sums put the
    outputs 5e-5 off (measured); the twin sums g between the two tokens instead: within 1e-6."""
    q, k, v, g, beta = _random_rule_inputs(64, seed=2, decay_scale=0.05)
    g[:20] = -200.0
    cu = torch.tensor([0, 64])
    assert (chunked_twin(q, k, v, g, beta, cu) - recurrent_twin(q, k, v, g, beta, cu)).abs().max().item() <= 1e-6


def test_chunked_twin_in_bf16_is_the_float32_result_rounded():
    """bf16 inputs (as the bf16 trainer passes them; g is float32 there): the output is the float32
    result on those bf16 values rounded once to bf16, exactly; against the float32 result on the
    full-precision inputs, outputs and the bf16 gradients are within 2e-2 of the largest (the
    inputs' rounding, 2^-9 relative each, carried through)."""
    lengths = [70, 1, 20]
    inputs = _random_rule_inputs(sum(lengths), seed=3)
    cu = torch.tensor([0, 70, 71, 91])
    weight = torch.randn(inputs[2].shape, generator=torch.Generator().manual_seed(4))
    low_inputs = [x if i == 3 else x.bfloat16() for i, x in enumerate(inputs)]
    got, got_grads = _run_with_grads(chunked_twin, low_inputs, cu, weight)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, chunked_twin(*(x.float() for x in low_inputs), cu).bfloat16())
    want, want_grads = _run_with_grads(chunked_twin, inputs, cu, weight)
    assert (got.float() - want).abs().max().item() <= 2e-2 * want.abs().max().item()
    for name, x, a, b in zip("q k v g beta".split(), low_inputs, got_grads, want_grads):
        assert a.dtype == x.dtype and torch.isfinite(a).all(), name
        assert (a.float() - b).abs().max().item() <= 2e-2 * b.abs().max().item(), name


def _saved_state_storages(rule, inputs, cu) -> int:
    """How many distinct storages autograd keeps holding `[.., H_v, d_k, d_v]`-shaped tensors."""
    shape = (inputs[2].shape[1], inputs[0].shape[2], inputs[2].shape[2])
    storages = set()

    def pack(t):
        if tuple(t.shape[-3:]) == shape:
            storages.add(t.untyped_storage().data_ptr())
        return t

    xs = [x.detach().clone().requires_grad_() for x in inputs]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rule(*xs, cu)
    return len(storages)


def test_the_chunked_twin_keeps_one_state_per_chunk_for_the_backward():
    """d_k = 16, d_v = 8 (so no other saved tensor has a state's shape): one sequence of 256 tokens
    is 4 chunks of 64 and autograd keeps 4 states (the ones each chunk starts from); a row of 130,
    70 and 5 tokens keeps 3, one per chunk position (the sequences' states in one tensor). The
    recurrence keeps one per token: at least 256."""
    assert CHUNK == 64
    inputs = _random_rule_inputs(256, seed=7, dv=8)
    assert _saved_state_storages(chunked_twin, inputs, torch.tensor([0, 256])) == 4
    assert _saved_state_storages(chunked_twin, [x[:205] for x in inputs], torch.tensor([0, 130, 200, 205])) == 3
    assert _saved_state_storages(recurrent_twin, inputs, torch.tensor([0, 256])) >= 256


def test_the_platform_picks_the_twin_on_cpu():
    """CPU tensors always take the chunked twin (fla's kernel is Triton: CUDA only)."""
    from mrl.platform.delta_rule import gated_delta_rule, kernel_name

    assert kernel_name("cpu") == "twin"
    q, k, v, g, beta = _random_rule_inputs(5, seed=4)
    cu = torch.tensor([0, 5])
    assert torch.equal(gated_delta_rule(q, k, v, g, beta, cu), chunked_twin(q, k, v, g, beta, cu))


def test_packed_causal_conv_equals_conv1d_per_sequence():
    """The depthwise causal conv (kernel 4) over a packed row equals F.conv1d with 3 zeros of left
    padding on each sequence alone."""
    from mrl.models.gated_deltanet import _positions, causal_conv_packed

    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(11, 6, generator=g), torch.randn(6, 1, 4, generator=g)
    cu = torch.tensor([0, 5, 6, 11])
    got = causal_conv_packed(x, w, _positions(cu, 11))
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        want = F.conv1d(x[a:b].T[None], w, padding=3, groups=6)[0, :, : b - a].T
        assert (got[a:b] - want).abs().max().item() <= 1e-6


def _dims():
    from mrl.weights.transforms import ModelDims

    return ModelDims(num_query_groups=2, heads_per_group=2, head_dim=1, vocab_size=1, linear=(2, 4, 1, 1))


def test_gated_qkv_by_hand_and_through_tp():
    """Qwen3-Next's q_proj rows per head [q_h, gate_h] (head dim 1, 4 heads in 2 groups): megatron
    groups [q q | gate gate | k | v]; TP rank r holds group r; back to HF exactly."""
    from mrl.weights.transforms import GATED_QKV

    q = torch.tensor([10., 11., 20., 21., 30., 31., 40., 41.])[:, None]   # head h: q = h0, gate = h1
    k, v = torch.tensor([[1.], [2.]]), torch.tensor([[5.], [6.]])
    readers = [_Mem(q), _Mem(k), _Mem(v)]
    full = GATED_QKV.shard_from_hf(readers, 0, 1, 0, (12, 1), _dims())
    assert full.flatten().tolist() == [10, 20, 11, 21, 1, 5, 30, 40, 31, 41, 2, 6]
    shards = [GATED_QKV.shard_from_hf(readers, r, 2, 0, (12, 1), _dims()) for r in range(2)]
    assert torch.equal(torch.cat(shards), full)
    back = GATED_QKV.to_hf(shards, 0, _dims())
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))
    assert GATED_QKV.hf_shapes((12, 1), _dims()) == [(8, 1), (2, 1), (2, 1)]


def test_deltanet_in_proj_and_conv_by_hand_and_through_tp():
    """2 key heads of dim 1, 4 value heads of dim 1. Qwen3-Next's in_proj_qkvz per key head
    [q k v v z z] and in_proj_ba per key head [b b a a]; Qwen3.5's [q q | k k | v v v v], z, b, a;
    the conv's channels [q q | k k | v v v v]. TP rank r holds key head r: [q_r k_r v_r z_r b_r a_r]."""
    from mrl.weights.transforms import DELTANET_CONV, DELTANET_QKV_Z_B_A, DELTANET_QKVZ_BA

    dims = _dims()
    qkvz = torch.tensor([1., 2., 3., 4., 5., 6., 11., 12., 13., 14., 15., 16.])[:, None]
    ba = torch.tensor([7., 8., 9., 10., 17., 18., 19., 20.])[:, None]
    ranks = [DELTANET_QKVZ_BA.shard_from_hf([_Mem(qkvz), _Mem(ba)], r, 2, 0, (16, 1), dims) for r in range(2)]
    assert ranks[0].flatten().tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert ranks[1].flatten().tolist() == [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    whole = DELTANET_QKVZ_BA.shard_from_hf([_Mem(qkvz), _Mem(ba)], 0, 1, 0, (16, 1), dims)
    assert whole.flatten().tolist() == [1, 11, 2, 12, 3, 4, 13, 14, 5, 6, 15, 16, 7, 8, 17, 18, 9, 10, 19, 20]
    for shards in (ranks, [whole]):
        assert all(torch.equal(a, b) for a, b in zip(DELTANET_QKVZ_BA.to_hf(shards, 0, dims), (qkvz, ba)))

    qkv = torch.tensor([1., 11., 2., 12., 3., 4., 13., 14.])[:, None]
    z, b, a = (torch.tensor([5., 6., 15., 16.])[:, None], torch.tensor([7., 8., 17., 18.])[:, None],
               torch.tensor([9., 10., 19., 20.])[:, None])
    readers = [_Mem(t) for t in (qkv, z, b, a)]
    split = [DELTANET_QKV_Z_B_A.shard_from_hf(readers, r, 2, 0, (16, 1), dims) for r in range(2)]
    assert all(torch.equal(x, y) for x, y in zip(split, ranks))       # the same megatron rows
    assert all(torch.equal(x, y) for x, y in zip(DELTANET_QKV_Z_B_A.to_hf(split, 0, dims), (qkv, z, b, a)))

    conv = qkv.view(8, 1, 1)
    shards = [DELTANET_CONV.shard_from_hf([_Mem(conv)], r, 2, 0, (8, 1, 1), dims) for r in range(2)]
    assert [s.flatten().tolist() for s in shards] == [[1, 2, 3, 4], [11, 12, 13, 14]]
    assert torch.equal(DELTANET_CONV.to_hf(shards, 0, dims)[0], conv)


@pytest.fixture(scope="module")
def platform():
    from mrl import platform as plat
    from mrl.platform.config import ParallelConfig, PlatformConfig

    ctx = plat.setup(PlatformConfig(device="cpu", ranks_per_node=1, cpu_threads=1), ParallelConfig(), seed=11)
    yield ctx
    plat.teardown()


@pytest.mark.parametrize("arch", HYBRIDS)
def test_logits_and_packed_rows_match_transformers(platform, tmp_path, arch):
    """A tiny hybrid through megatron (TP1) against transformers on the same weights: 2 x 40-token
    sequences within 1e-5 in float32; the two sequences packed in one row (plus a 7-token one)
    give each sequence's unpacked logits (the conv and the recurrence restart at each start)."""
    from transformers import AutoModelForCausalLM

    from mrl.engine.packing import _thd_params
    from mrl.models.megatron import complete_hf_config, position_ids
    from mrl.models.roles import build_role_model
    from mrl.platform.config import ParallelConfig
    from mrl.weights import load_hf_checkpoint

    ref = make_hf_model(arch, tmp_path).eval()
    hf = complete_hf_config(json.loads((tmp_path / "config.json").read_text()))
    model = build_role_model("actor", hf, ParallelConfig(), dtype="float32", device="cpu").eval()
    load_hf_checkpoint([model], tmp_path, hf)
    tokens = probe_tokens(hf["vocab_size"], seq=40)
    with torch.no_grad():
        want = ref(tokens).logits
        got = model(tokens, position_ids(*tokens.shape), None)[..., : hf["vocab_size"]]
        assert (got - want).abs().max().item() <= 1e-5
        lengths = [40, 7, 40]
        extra = probe_tokens(hf["vocab_size"], batch=1, seq=7, seed=3)[0]
        row = torch.cat([tokens[0], extra, tokens[1]])[None]
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        packed = model(row, pos, None, packed_seq_params=_thd_params(lengths, "cpu"))[0, :, : hf["vocab_size"]]
        alone = model(extra[None], position_ids(1, 7), None)[0, :, : hf["vocab_size"]]
    assert (packed[:40] - got[0]).abs().max().item() <= 1e-5
    assert (packed[47:] - got[1]).abs().max().item() <= 1e-5
    assert (packed[40:47] - alone).abs().max().item() <= 1e-5


def test_refusals_are_one_line():
    """What mrl does not build for the hybrids is one line each at validate: context parallelism,
    key heads TP does not divide, vLLM / SGLang engines (the multimodal Qwen3.5 builds:
    tests/weights/test_qwen3_5_vlm.py)."""
    from mrl.models.facts import engine_problem, find_hf_config
    from mrl.models.megatron import architecture_problems

    hf = find_hf_config("builtin:tiny-qwen3-next")[0]
    assert architecture_problems(hf) == []
    (cp,) = architecture_problems(hf, context_parallel=2)
    assert cp.startswith("parallel.context:") and "\n" not in cp
    (tp,) = architecture_problems(hf, tensor_parallel=4)
    assert "linear_num_key_heads 2" in tp
    multimodal = {"model_type": "qwen3_5", "text_config": find_hf_config("builtin:tiny-qwen3.5")[0],
                  "vision_config": {}}
    assert architecture_problems(multimodal) == []
    assert "rollout.engine = 'hf'" in engine_problem("qwen3_next", "vllm")
    from mrl.models.lora import LoraConfig, lora_problems

    ((key, message),) = lora_problems(LoraConfig(rank=8), "actor.lora", model_type="qwen3_5_text")
    assert key == "actor.lora.rank" and "LoRA on qwen3_5_text is not supported yet" in message
    assert engine_problem("qwen3_5_moe_text", "hf") is None


def test_delta_rule_benchmark_runs_and_prints_its_ratios(tmp_path, capsys, monkeypatch):
    """tools/bench/delta_rule.py at toy size (in process): both twins agree and the recurrence
    keeps more bytes for the backward than the chunked twin (one state per token against one per
    chunk); the figures it prints are the ones it writes as JSON."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools/bench/delta_rule.py"
    spec = importlib.util.spec_from_file_location("delta_rule_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out_json = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["delta_rule.py", "--tokens", "130", "200", "--shapes", "tiny", "--iters", "1",
                                      "--warmup", "0", "--skip-recurrent-above", "150", "--json", str(out_json)])
    bench.main()
    printed = capsys.readouterr().out
    small, large = json.loads(out_json.read_text())
    assert (small["tokens"], large["tokens"]) == (130, 200) and small["sequences"] == 1
    assert small["max_abs_diff"] <= 1e-5 and small["memory_ratio"] > 1
    assert "recurrent" not in large["ms"] and "recurrent skipped" in printed
    assert f"memory {small['memory_ratio']:6.1f}x" in printed
