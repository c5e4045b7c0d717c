"""The vLLM readback mapping (mrl/rollout/vllm_readback.py) without vLLM, and delta syncs by load unit.

The sharding below is written out by hand from vLLM's loaders (QKVParallelLinear.weight_loader:
q rows of rank r = [r*q, (r+1)*q), k/v rows of rank r = those of KV shard r // replicas;
MergedColumnParallelLinear: each part split evenly; RowParallelLinear: columns; the vocabulary
padded, then split evenly). `assemble` must invert it bit for bit; the vLLM tier checks the same
against vLLM itself (scripts/vllm_checks.py).
"""
from __future__ import annotations

import pytest
import torch

from mrl.rollout.vllm_readback import Layout, Source, assemble, load_unit, source_of

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def test_hf_names_map_to_vllm_modules_and_parts():
    assert source_of("model.layers.3.self_attn.k_proj.weight", PACKED) == Source("model.layers.3.self_attn.qkv_proj",
                                                                                  "weight", 1)
    assert source_of("model.layers.0.self_attn.v_proj.bias", PACKED) == Source("model.layers.0.self_attn.qkv_proj",
                                                                                "bias", 2)
    assert source_of("model.layers.1.mlp.up_proj.weight", PACKED) == Source("model.layers.1.mlp.gate_up_proj",
                                                                             "weight", 1)
    assert source_of("model.layers.1.mlp.down_proj.weight", PACKED) == Source("model.layers.1.mlp.down_proj", "weight")
    assert source_of("model.norm.weight", PACKED) == Source("model.norm", "weight")
    assert source_of("lm_head.weight", PACKED) == Source("lm_head", "weight")
    # one unit per fused module: q/k/v weights and biases together, o_proj alone
    units = {load_unit(f"model.layers.0.self_attn.{p}.{a}", PACKED) for p in ("q_proj", "k_proj", "v_proj")
             for a in ("weight", "bias")}
    assert units == {"model.layers.0.self_attn.qkv_proj"}
    assert load_unit("model.layers.0.self_attn.o_proj.weight", PACKED) == "model.layers.0.self_attn.o_proj"


def _bits(t):   # distinct bit patterns, bf16 (NaN, -0.0 and subnormals included)
    return torch.arange(t, dtype=torch.int16).mul_(7919).view(torch.bfloat16)


@pytest.mark.parametrize("tp,heads,kv_heads", [(1, 4, 2), (2, 4, 2), (4, 4, 2), (4, 8, 1)])
def test_qkv_pieces_reassemble_bit_for_bit(tp, heads, kv_heads):
    head, hidden = 3, 5
    full = {p: _bits(n * head * hidden).view(torch.int16).add(i * 101).view(torch.bfloat16).reshape(n * head, hidden)
            for i, (p, n) in enumerate((("q", heads), ("k", kv_heads), ("v", kv_heads)))}
    local_heads, replicas = heads // tp, max(tp // kv_heads, 1)
    local_kv = max(kv_heads // tp, 1)
    pieces = []
    for r in range(tp):   # what QKVParallelLinear.weight_loader writes into rank r's parameter
        q = full["q"][r * local_heads * head:(r + 1) * local_heads * head]
        s = r // replicas
        k = full["k"][s * local_kv * head:(s + 1) * local_kv * head]
        v = full["v"][s * local_kv * head:(s + 1) * local_kv * head]
        pieces.append(torch.cat([q, k, v]))
    layout = Layout("packed", part_rows=(local_heads * head, local_kv * head, local_kv * head),
                    replicas=(1, replicas, replicas))
    for part, name in enumerate("qkv"):
        got = assemble(layout, part, pieces)
        assert torch.equal(got.view(torch.int16), full[name].view(torch.int16)), (tp, name)


def test_gate_up_row_vocab_and_replicated_pieces_reassemble():
    tp, inter, hidden, vocab, padded = 2, 8, 6, 10, 12
    gate, up = _bits(inter * hidden).reshape(inter, hidden), _bits(inter * hidden).flip(0).reshape(inter, hidden)
    half = inter // tp
    merged = [torch.cat([gate[r * half:(r + 1) * half], up[r * half:(r + 1) * half]]) for r in range(tp)]
    layout = Layout("packed", part_rows=(half, half), replicas=(1, 1))
    assert torch.equal(assemble(layout, 0, merged).view(torch.int16), gate.view(torch.int16))
    assert torch.equal(assemble(layout, 1, merged).view(torch.int16), up.view(torch.int16))

    down = _bits(hidden * inter).reshape(hidden, inter)
    cols = [down[:, r * half:(r + 1) * half] for r in range(tp)]
    assert torch.equal(assemble(Layout("row"), None, cols).view(torch.int16), down.view(torch.int16))
    bias = _bits(hidden)
    assert torch.equal(assemble(Layout("row"), None, [bias, bias]), bias)   # a row-parallel bias is replicated

    emb = _bits(vocab * hidden).reshape(vocab, hidden)
    table = torch.cat([emb, torch.zeros(padded - vocab, hidden, dtype=emb.dtype)])
    rows = [table[r * padded // tp:(r + 1) * padded // tp] for r in range(tp)]
    assert torch.equal(assemble(Layout("vocab", rows=vocab), None, rows).view(torch.int16), emb.view(torch.int16))

    norm = _bits(hidden)
    assert torch.equal(assemble(Layout("replicated"), None, [norm]), norm)
    with pytest.raises(ValueError):
        assemble(layout, None, merged)


def test_delta_sync_sends_a_whole_load_unit_when_one_of_its_tensors_changed():
    from mrl.weights.delta import Bucket, WeightSender

    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
             "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    weights = {n: torch.randn(4, 4).to(torch.bfloat16) for n in names}
    sender = WeightSender(mode="delta", sparse_fraction=0.5, unit_of=lambda n: load_unit(n, PACKED))

    def sent(version):
        msgs = list(sender.encode(list(weights.items()), version))
        return {it.name: it for m in msgs if isinstance(m, Bucket) for it in m.items}

    assert set(sent(1)) == set(names)   # the first sync is full
    assert sent(2) == {}                # nothing changed, nothing sent
    weights["model.layers.0.self_attn.k_proj.weight"] = weights["model.layers.0.self_attn.k_proj.weight"].clone()
    weights["model.layers.0.self_attn.k_proj.weight"][0, 0] += 1   # one element of k: q, k and v go, whole
    items = sent(3)
    assert set(items) == set(names[:3]) and not any(it.sparse for it in items.values())
    assert all(torch.equal(items[n].values, weights[n]) for n in names[:3])
    weights["model.layers.0.self_attn.o_proj.weight"] = weights["model.layers.0.self_attn.o_proj.weight"].clone()
    weights["model.layers.0.self_attn.o_proj.weight"][1, 1] += 1   # a unit of one tensor may still go sparse
    items = sent(4)
    assert set(items) == {"model.layers.0.self_attn.o_proj.weight"} and items[names[3]].sparse


def test_tensors_an_engine_cannot_read_back_are_reported_once_and_others_still_checked(caplog):
    from mrl.rollout.weight_channel import ColocatedChannel
    from mrl.weights.verify import WeightSyncError

    class Engine:   # holds what it loads; cannot read back "b" (as vLLM cannot read fused MoE experts)
        accepts_sparse = False

        def __init__(self):
            self.w = {}

        def load_unit(self, name):
            return name

        def update_weights(self, stream, partial=False):
            n = 0
            for name, t in stream:
                self.w[name] = t.clone()
                n += 1
            return n

        def held_weights(self, names):
            for name in names:
                yield name, (None if name == "b" else self.w[name])

    eng = Engine()
    channel = ColocatedChannel(eng, verify_every_steps=1, group="0 (rank 0)")
    weights = [("a", torch.ones(3)), ("b", torch.zeros(2))]
    with caplog.at_level("WARNING"):
        channel.push(weights, 1)
        channel.push(weights, 2)
    warned = [r.getMessage() for r in caplog.records if "cannot be read back" in r.getMessage()]
    assert warned == ["weight verification: 1 of 2 tensors cannot be read back from the Engine engine (e.g. b); "
                      "they are checked on arrival only"]
    eng.w["a"][1] = 2.0
    with pytest.raises(WeightSyncError, match=r"^weight verification: a at engine group 0 \(rank 0\) differs"):
        channel.push(weights[1:], 3)   # a full-mode sync of b alone; a is verified from version 2's checksum
