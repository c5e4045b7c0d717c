"""gpt-oss pieces by hand (world 1): the interleaved / transposed expert transforms, the stacked
and MXFP4 expert rows, attention sinks and windows; an MXFP4 checkpoint against `transformers`."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from mrl.weights.transforms import INTERLEAVED_GATE_UP, TRANSPOSED, ModelDims
from tests.weights.archs import make_hf_model, probe_tokens
from tests.weights.test_weights import _Mem

_DIMS = ModelDims(num_query_groups=1, heads_per_group=1, head_dim=1, vocab_size=1)


def test_interleaved_gate_up_by_hand_and_through_tp():
    """HF `[H=1, 2I=4]` = [g0 u0 g1 u1] -> megatron `[gate; up]` rows [g0 g1 u0 u1]; TP rank r holds
    [g_r; u_r]; the bias `[2I]` the same way; back to HF exactly."""
    hf = torch.tensor([[10., 20., 11., 21.]])
    full = INTERLEAVED_GATE_UP.shard_from_hf([_Mem(hf)], 0, 1, 0, (4, 1), _DIMS)
    assert full.flatten().tolist() == [10, 11, 20, 21]
    shards = [INTERLEAVED_GATE_UP.shard_from_hf([_Mem(hf)], r, 2, 0, (4, 1), _DIMS) for r in range(2)]
    assert [s.flatten().tolist() for s in shards] == [[10, 20], [11, 21]]
    assert torch.equal(INTERLEAVED_GATE_UP.to_hf(shards, 0, _DIMS)[0], hf)
    bias = hf[0]
    assert INTERLEAVED_GATE_UP.shard_from_hf([_Mem(bias)], 0, 1, 0, (4,), _DIMS).tolist() == [10, 11, 20, 21]
    assert torch.equal(INTERLEAVED_GATE_UP.to_hf([full.flatten()], 0, _DIMS)[0], bias)
    assert INTERLEAVED_GATE_UP.hf_shapes((4, 1), _DIMS) == [(1, 4)]


@pytest.mark.parametrize("tp", [1, 2])
def test_transposed_down_proj_through_tp(tp):
    """gpt-oss' `down_proj` `[I, H]` is megatron's row-parallel `[H, I]`: rank r holds columns of
    megatron's (rows of HF's)."""
    down = torch.arange(12.).reshape(4, 3)                    # [I=4, H=3]
    shards = [TRANSPOSED.shard_from_hf([_Mem(down)], r, tp, 1, (3, 4), _DIMS) for r in range(tp)]
    assert torch.equal(torch.cat(shards, dim=1), down.T)
    assert torch.equal(TRANSPOSED.to_hf(shards, 1, _DIMS)[0], down)


def test_stacked_rows_by_hand():
    """Stacked `[E, ...]` tensors become per-expert rows and back; MXFP4 blocks dequantize by the
    FP4 table and the power-of-two scale (byte 0x21: low nibble 1 = +0.5, high nibble 2 = +1.0)."""
    from mrl.weights.stacked import expert_rows, read_row, row_shape, stack_experts

    shapes = {"m.experts.down_proj": (2, 3, 4), "m.experts.gate_up_proj_blocks": (2, 8, 1, 16),
              "m.experts.gate_up_proj_scales": (2, 8, 1), "m.router.weight": (2, 4)}
    rows = expert_rows(shapes)
    assert sorted(rows) == ["m.experts.0.down_proj", "m.experts.0.gate_up_proj", "m.experts.1.down_proj",
                            "m.experts.1.gate_up_proj"]
    assert row_shape(rows["m.experts.1.gate_up_proj"], shapes) == (32, 8)
    blocks = torch.zeros(2, 8, 1, 16, dtype=torch.uint8)
    blocks[1, 3, 0, 0] = 0x21
    scales = torch.full((2, 8, 1), 127, dtype=torch.uint8)
    scales[1, 3, 0] = 129                                      # x 2^2
    row = read_row(rows["m.experts.1.gate_up_proj"], [blocks, scales], 1)
    assert row.shape == (32, 8) and row[0, 3].item() == 2.0 and row[1, 3].item() == 4.0
    assert row.abs().sum().item() == 6.0
    down = torch.arange(24.).reshape(2, 3, 4)
    assert torch.equal(read_row(rows["m.experts.1.down_proj"], [down], 1), down[1])
    stream = [("a", torch.ones(1)), ("m.experts.0.down_proj", down[0]), ("m.experts.1.down_proj", down[1])]
    out = dict(stack_experts(stream, {"num_local_experts": 2}))
    assert list(out) == ["a", "m.experts.down_proj"] and torch.equal(out["m.experts.down_proj"], down)
    with pytest.raises(RuntimeError, match="1 of 2 expert rows"):
        list(stack_experts(stream[:2], {"num_local_experts": 2}))


def test_sink_and_window_attention_by_hand():
    """One head, 3 tokens, q = k = 0 (every logit 0), v = 1, 2, 4: token 2 with window 1 sees
    tokens 1 and 2 (mean 3); a sink of log 2 takes 2 parts of 4 (3 x 2/4 = 1.5); no window and
    no sink: the mean of all 3."""
    from mrl.models.sink_attention import eager_packed

    q = k = torch.zeros(3, 1, 1)
    v = torch.tensor([1., 2., 4.]).view(3, 1, 1)
    cu = torch.tensor([0, 3])
    assert eager_packed(q, k, v, cu, 1.0)[:, 0, 0].tolist() == pytest.approx([1, 1.5, 7 / 3])
    assert eager_packed(q, k, v, cu, 1.0, window=1)[:, 0, 0].tolist() == pytest.approx([1, 1.5, 3])
    sinks = torch.tensor([math.log(2.0)])
    assert eager_packed(q, k, v, cu, 1.0, window=1, sinks=sinks)[2, 0, 0].item() == pytest.approx(1.5)


@pytest.fixture(scope="module")
def platform():
    from mrl import platform as plat
    from mrl.platform.config import ParallelConfig, PlatformConfig

    ctx = plat.setup(PlatformConfig(device="cpu", ranks_per_node=1, cpu_threads=1), ParallelConfig(), seed=11)
    yield ctx
    plat.teardown()


def test_mxfp4_checkpoint_loads_dequantized_like_transformers(platform, tmp_path):
    """A gpt-oss checkpoint with MXFP4 experts (random FP4 codes and scales; its quantization_config
    as published): mrl's Megatron model holds transformers' dequantization (one value by hand), its
    logits equal those of transformers loading the same directory within 1e-5, and the export is
    the dequantized model, unquantized."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from mrl.models.megatron import complete_hf_config, position_ids
    from mrl.models.roles import build_role_model
    from mrl.platform.config import ParallelConfig
    from mrl.weights import Exporter, load_hf_checkpoint
    from mrl.weights.stacked import stack_experts

    make_hf_model("gpt_oss", tmp_path, intermediate_size=64)   # MXFP4 packs 32 values a row block
    w = load_file(tmp_path / "model.safetensors")
    g = torch.Generator().manual_seed(3)
    for layer in range(2):
        for proj, rows, cols in (("gate_up_proj", 128, 64), ("down_proj", 64, 64)):
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            w.pop(name)
            w[name + "_blocks"] = torch.randint(0, 256, (4, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
            w[name + "_scales"] = torch.randint(121, 126, (4, rows, cols // 32), generator=g, dtype=torch.uint8)
    blocks, scales = w["model.layers.0.mlp.experts.gate_up_proj_blocks"], w["model.layers.0.mlp.experts.gate_up_proj_scales"]
    blocks[0, 0, 0, 0], scales[0, 0, 0] = 0x21, 128            # gate row 0 of expert 0: +0.5, +1.0, x 2
    save_file(w, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    hf = complete_hf_config(cfg)
    model = build_role_model("actor", hf, ParallelConfig(), dtype="float32", device="cpu").eval()
    load_hf_checkpoint([model], tmp_path, hf)
    fc1 = model.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1.weight
    assert fc1[0, :2].tolist() == [1.0, 2.0]
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()   # dequantizes on CPU
    tokens = probe_tokens(hf["vocab_size"])
    with torch.no_grad():
        want = ref(tokens).logits
        got = model(tokens, position_ids(*tokens.shape), None)[..., : hf["vocab_size"]]
    assert (got - want).abs().max().item() <= 1e-5
    exported = dict(stack_experts(Exporter([model], hf).stream(), hf))
    assert not any(n.endswith(("_blocks", "_scales")) for n in exported)
    assert torch.equal(exported["model.layers.0.mlp.experts.gate_up_proj"],
                       convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    assert torch.equal(exported["model.layers.0.mlp.experts.gate_up_proj"],
                       ref.model.layers[0].mlp.experts.gate_up_proj.data)


def test_yarn_rope_attention_factor_on_a_dense_model_matches_transformers(platform, tmp_path):
    """yarn RoPE (Qwen2.5's long-context scaling, gpt-oss') multiplies cos and sin by its attention
    factor (0.1 ln 4 + 1 here); mrl folds its square into the softmax scale: a qwen2 with yarn x4
    over 32 original positions matches transformers within 1e-5 on 48 tokens."""
    from mrl.models.megatron import complete_hf_config, position_ids, rope_attention_factor
    from mrl.models.roles import build_role_model
    from mrl.platform.config import ParallelConfig
    from mrl.weights import load_hf_checkpoint

    yarn = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32)
    ref = make_hf_model("qwen2", tmp_path, rope_parameters=yarn).eval()
    hf = complete_hf_config(json.loads((tmp_path / "config.json").read_text()))
    assert rope_attention_factor(hf) == pytest.approx(0.1 * math.log(4.0) + 1.0)
    model = build_role_model("actor", hf, ParallelConfig(), dtype="float32", device="cpu").eval()
    load_hf_checkpoint([model], tmp_path, hf)
    tokens = probe_tokens(hf["vocab_size"], seq=48)
    with torch.no_grad():
        got = model(tokens, position_ids(*tokens.shape), None)[..., : hf["vocab_size"]]
        assert (got - ref(tokens).logits).abs().max().item() <= 1e-5
