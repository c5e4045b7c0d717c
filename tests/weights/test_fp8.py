"""Blockwise FP8 rollout weights: the quantizer, the stream transform, the hf engine and delta sync.

Byte equality with vLLM's own quantizer is checked in the vLLM tier
(`tests/rollout/test_fp8_vllm_ref.py`); here the expectations are checkable by hand."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mrl.models.facts import BUILTIN_PRESETS
from mrl.rollout.hf import HFEngine
from mrl.rollout.weight_channel import ColocatedChannel
from mrl.weights.fp8 import (FP8, Fp8Stream, dequantize_block_fp8, e4m3_error_bound, quantize_block_fp8)
from mrl.weights.verify import same_bits


def test_a_block_whose_largest_element_is_448_has_scale_1_and_exact_values():
    w = torch.zeros(128, 128)
    w[0, 0], w[5, 7], w[127, 127] = 448.0, -1.5, 0.0390625   # all representable in e4m3
    q, s = quantize_block_fp8(w)
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (1, 1)
    assert s.item() == 1.0
    assert torch.equal(q.float(), w)


def test_scales_are_per_128x128_block_and_partial_blocks_are_padded():
    w = torch.ones(130, 260)
    w[:128, :128] *= 2.0
    w[128:, 256:] *= 8.0
    q, s = quantize_block_fp8(w)
    assert q.shape == (130, 260) and s.shape == (2, 3)
    assert s[0, 0].item() == pytest.approx(2.0 / 448) and s[1, 2].item() == pytest.approx(8.0 / 448)
    assert s[0, 1].item() == pytest.approx(1.0 / 448)
    # an all-zero block keeps a finite scale (amax floor 1e-4)
    q0, s0 = quantize_block_fp8(torch.zeros(4, 4))
    assert s0.item() == pytest.approx(1e-4 / 448) and not q0.float().any()


def within_bound(err, bound, w) -> bool:
    """err <= bound, up to the float32 rounding of computing both (a tie, x / s = 10.5 rounding to
    10, sits exactly on the bound: real weights have them)."""
    return bool((err <= bound * (1 + 1e-6) + 2.0 ** -22 * w.float().abs()).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("power_of_two", [False, True])
def test_the_round_trip_error_is_within_the_e4m3_bound_of_every_block(dtype, power_of_two):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(300, 200, generator=g) * torch.logspace(-3, 0, 200)).to(dtype)   # blocks of different ranges
    q, s = quantize_block_fp8(w, power_of_two=power_of_two)
    if power_of_two:
        assert torch.equal(s, torch.pow(2.0, torch.round(torch.log2(s))))
    back = dequantize_block_fp8(q, s)
    err = (back - w.float()).abs()
    bound = e4m3_error_bound(w, s)
    assert within_bound(err, bound, w)
    assert err.max() > 0   # it does round
    # no element saturates: every block's largest magnitude maps to at most 448
    assert q.float().abs().max() <= 448


def test_the_stream_quantizes_linear_weights_and_keeps_embeddings_norms_head_and_routers():
    names = [("model.embed_tokens.weight", (512, 128)), ("model.layers.0.input_layernorm.weight", (128,)),
             ("model.layers.0.self_attn.q_proj.weight", (128, 128)), ("model.layers.0.self_attn.q_proj.bias", (128,)),
             ("model.layers.0.mlp.gate.weight", (4, 128)), ("model.layers.0.mlp.experts.0.gate_proj.weight", (32, 128)),
             ("model.layers.0.mlp.shared_expert_gate.weight", (1, 128)), ("model.norm.weight", (128,)),
             ("lm_head.weight", (512, 128))]
    out = list(Fp8Stream()((n, torch.randn(s)) for n, s in names))
    assert [(n, t.dtype) for n, t in out] == [
        ("model.embed_tokens.weight", torch.float32), ("model.layers.0.input_layernorm.weight", torch.float32),
        ("model.layers.0.self_attn.q_proj.weight", FP8), ("model.layers.0.self_attn.q_proj.weight_scale_inv", torch.float32),
        ("model.layers.0.self_attn.q_proj.bias", torch.float32), ("model.layers.0.mlp.gate.weight", torch.float32),
        ("model.layers.0.mlp.experts.0.gate_proj.weight", FP8),
        ("model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv", torch.float32),
        ("model.layers.0.mlp.shared_expert_gate.weight", torch.float32), ("model.norm.weight", torch.float32),
        ("lm_head.weight", torch.float32)]
    custom = Fp8Stream(skip=("embed_tokens", "lm_head", "norm", r"\.mlp\.gate\.weight$", "down_proj"))
    assert not custom.quantizes("model.layers.3.mlp.down_proj.weight", (128, 256))
    assert custom.ignored_modules([("model.layers.3.mlp.down_proj.weight", (128, 256)),
                                   ("model.layers.3.mlp.gate.weight", (4, 128)), ("lm_head.weight", (5, 128))]) \
        == ["model.layers.3.mlp.down_proj", "model.layers.3.mlp.gate"]
    # bytes on the wire: 1 per element plus 4 per block's scale
    assert Fp8Stream().nbytes("x.q_proj.weight", (256, 130), 2) == 256 * 130 + 4 * 2 * 2
    assert Fp8Stream().nbytes("model.norm.weight", (130,), 2) == 260


def _engine(seed, name="tiny-llama", dtype="float32"):
    torch.manual_seed(seed)
    return HFEngine.from_config(BUILTIN_PRESETS[name], dtype=dtype)


class Trainer:
    """fp32 master weights, exported in bf16 after an Adam-sized update each step."""

    def __init__(self, engine, seed=1):
        g = torch.Generator().manual_seed(seed)
        self.master = {n: torch.randn(p.shape, generator=g) * 0.05 for n, p in engine.model.named_parameters()}
        self.g = g

    def step(self, lr):
        for w in self.master.values():
            w.add_(torch.randn(w.shape, generator=self.g).sign() * lr * w.abs())

    def stream(self):
        return Fp8Stream()((n, w.to(torch.bfloat16)) for n, w in self.master.items())


def test_the_hf_engine_runs_the_dequantized_blocks_of_the_fp8_stream():
    engine = _engine(0)
    trainer = Trainer(engine)
    ColocatedChannel(engine, verify_every_steps=1).push(trainer.stream(), 0)
    params = dict(engine.model.named_parameters())
    name = "model.layers.0.mlp.down_proj.weight"
    q, s = quantize_block_fp8(trainer.master[name].to(torch.bfloat16))
    assert torch.equal(params[name], dequantize_block_fp8(q, s))
    assert not torch.equal(params[name], trainer.master[name].to(torch.bfloat16).float())   # it is rounded
    held = dict(engine.held_weights([name, name + "_scale_inv"]))
    assert torch.equal(held[name].view(torch.uint8), q.view(torch.uint8)) and torch.equal(held[name + "_scale_inv"], s)
    emb = "model.embed_tokens.weight"
    assert torch.equal(params[emb], trainer.master[emb].to(torch.bfloat16).float())   # kept in the export dtype


def test_delta_fp8_is_bit_identical_to_a_full_fp8_sync_after_every_step_of_20():
    full_engine, delta_engine = _engine(0, dtype="bfloat16"), _engine(1, dtype="bfloat16")
    trainer = Trainer(full_engine)
    full = ColocatedChannel(full_engine, mode="full", bucket_mb=0.05, verify_every_steps=1)
    delta = ColocatedChannel(delta_engine, mode="delta", bucket_mb=0.05, verify_every_steps=1)
    bf16_bytes = sum(w.numel() * 2 for w in trainer.master.values())
    sparse_seen = False
    for step in range(20):
        if step:
            trainer.step(1e-3 if step % 2 else 1e-5)
        full.push(trainer.stream(), step, lost=step == 0)
        delta.push(trainer.stream(), step, lost=step == 0)
        a, b = dict(full_engine.model.named_parameters()), dict(delta_engine.model.named_parameters())
        for n in a:
            assert same_bits(a[n].data, b[n].data).all(), (step, n)
        fa, fb = full_engine._fp8.tensors, delta_engine._fp8.tensors
        assert fa.keys() == fb.keys() and len(fa) == 2 * 14
        for n in fa:
            assert same_bits(fa[n], fb[n]).all(), (step, n)
        assert full.last.verified and delta.last.verified   # every tensor's checksum read back
        # 2 layers x (q, k, v, o, gate, up, down: 147,456 fp8 bytes + 10 blocks' scales), embeddings,
        # head and 5 norms in bf16: (65,536 + 65,536 + 640) x 2
        assert full.last.bytes_sent == 2 * (147456 + 10 * 4) + 131712 * 2 == 558416 < 0.66 * bf16_bytes
        if step:
            assert delta.last.bytes_sent < full.last.bytes_sent
            sparse_seen |= delta.last.tensors_sparse > 0
    assert sparse_seen   # some steps sent index/value pairs into the fp8 bytes


def smollm2_dir() -> Path | None:
    """A complete SmolLM2-135M-Instruct built by tools/models/smollm2.py: `$MRL_SMOLLM2`, its default
    output, or where jobs/smollm2_chainsum_cpu.toml reads it."""
    import os

    repo = Path(__file__).resolve().parents[2]
    for path in (os.environ.get("MRL_SMOLLM2"), Path.home() / ".cache/mrl/models/SmolLM2-135M-Instruct",
                 repo.parent / ".mrl-cache/models/SmolLM2-135M-Instruct"):
        if path and (Path(path) / "mrl_source.json").is_file():
            return Path(path)
    return None


def smollm2_weights() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(smollm2_dir().glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


@pytest.mark.skipif(smollm2_dir() is None, reason="SmolLM2-135M-Instruct not built here (tools/models/smollm2.py; "
                                                  "MRL_SMOLLM2=DIR)")
def test_smollm2_weights_round_trip_within_the_e4m3_bound():
    tensors = smollm2_weights()
    stream = Fp8Stream()
    checked = 0
    for name, w in tensors.items():
        if stream.quantizes(name, w.shape):
            q, s = quantize_block_fp8(w.to(torch.bfloat16))
            err = (dequantize_block_fp8(q, s) - w.to(torch.bfloat16).float()).abs()
            assert within_bound(err, e4m3_error_bound(w.to(torch.bfloat16), s), w), name
            checked += 1
    assert checked == 30 * 7


def test_vllm_is_started_with_the_block_fp8_config_of_the_stream_dense_and_moe():
    from mrl.config.loader import load
    from mrl.rollout.vllm_engine import engine_args

    jobs = Path(__file__).resolve().parents[2] / "jobs"
    for job, model, routers in (("quickstart_fp8_cpu.toml", "builtin:tiny-qwen2", []),
                                ("quickstart_moe_cpu.toml", "builtin:tiny-qwen3-moe",
                                 ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"])):
        spec, _ = load(str(jobs / job), ['rollout.quantization="fp8"', "rollout.fp8.power_of_two_scales=true"])
        kw = engine_args(spec.rollout, model, seed=0, dtype="bfloat16", max_model_len=64, rank=0, on_cpu=False)
        assert kw["quantization"] == "fp8"
        expected = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
        if routers:   # kept in bf16 by the skip list, so vLLM must not expect FP8 there
            expected["ignored_layers"] = routers
        assert kw["hf_overrides"] == {"quantization_config": expected}
    spec, _ = load(str(jobs / "quickstart_cpu.toml"), [])
    assert "hf_overrides" not in engine_args(spec.rollout, "builtin:tiny-qwen2", seed=0, dtype="bfloat16",
                                             max_model_len=64, rank=0, on_cpu=False)


def test_an_moe_engine_takes_fp8_experts_into_its_fused_expert_tensors_and_keeps_its_router():
    engine = _engine(0, "tiny-qwen3-moe")
    from mrl.weights.sync_plan import hf_tensors

    g = torch.Generator().manual_seed(3)
    # the checkpoint's tensors as the exporter streams them: per-expert projections, the router
    stream = {t.name: (torch.randn(t.shape, generator=g) * 0.05).to(torch.bfloat16)
              for t in hf_tensors(BUILTIN_PRESETS["tiny-qwen3-moe"])}
    quantized = sum(Fp8Stream().quantizes(n, t.shape) for n, t in stream.items())
    assert quantized == 2 * (4 + 4 * 3)   # per layer: q, k, v, o and 4 experts' gate, up, down
    assert engine.update_weights(Fp8Stream()(stream.items())) == len(stream) + quantized   # complete: no error
    expert = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert torch.equal(engine._targets[expert], dequantize_block_fp8(*quantize_block_fp8(stream[expert])))
    router = "model.layers.1.mlp.gate.weight"
    assert engine._targets[router].dtype == torch.float32 and router + "_scale_inv" not in engine._fp8.tensors
    assert torch.equal(engine._targets[router], stream[router].float())


def test_fp8_buckets_cross_the_byte_wire_of_separate_rollout_ranks_and_are_checked_there():
    from mrl.rollout.weight_channel import WeightReceiver
    from mrl.weights.delta import Bucket, WeightSender, pack, unpack
    from mrl.weights.verify import WeightSyncError

    engine, twin = _engine(0), _engine(1)
    trainer = Trainer(engine)
    ColocatedChannel(twin).push(trainer.stream(), 0)
    wire = [unpack(*pack(m)) for m in WeightSender(bucket_bytes=2**16).encode(trainer.stream(), 0)]
    fp8 = [it for m in wire if isinstance(m, Bucket) for it in m.items if it.values.dtype == FP8]
    assert len(fp8) == 14
    WeightReceiver(engine, "0").apply(wire, 0, full=True)   # every payload rehashed from the wire bytes
    for n, t in twin._fp8.tensors.items():
        assert same_bits(engine._fp8.tensors[n], t).all()
    fp8[0].values.view(torch.uint8)[7] ^= 1   # one bit of one FP8 byte, flipped on the wire
    with pytest.raises(WeightSyncError, match=f"{fp8[0].name} .*failed its checksum"):
        WeightReceiver(engine, "0").apply(wire, 0, full=True)


def test_validate_warns_about_fp8_without_rollout_correction_and_refuses_a_bad_skip_pattern(capsys):
    from mrl.cli import main

    jobs = Path(__file__).resolve().parents[2] / "jobs"
    assert main(["validate", str(jobs / "quickstart_cpu.toml"), 'rollout.quantization="fp8"']) == 0
    out = capsys.readouterr()
    warned = [line for line in (out.out + out.err).splitlines() if "rollout.quantization" in line]
    assert len(warned) == 1 and 'level = "token"' in warned[0] and "threshold = 2.0" in warned[0], warned
    assert main(["validate", str(jobs / "quickstart_fp8_cpu.toml")]) == 0   # the shipped job sets token TIS
    out = capsys.readouterr()
    assert "rollout.quantization" not in out.out + out.err
    assert main(["validate", str(jobs / "quickstart_fp8_cpu.toml"), 'rollout.fp8.skip=["(lm_head"]']) != 0
    out = capsys.readouterr()
    assert "rollout.fp8.skip: '(lm_head' is not a regular expression" in out.out + out.err


def test_the_fp8_gemm_equals_the_product_of_the_quantized_operands():
    from mrl.rollout.hf_fp8 import act_quant, block_fp8_matmul

    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 256, generator=g)
    w = torch.randn(200, 256, generator=g) * 0.05
    q, s = quantize_block_fp8(w)
    got = block_fp8_matmul(x, q, s, out_dtype=torch.float32)
    x_q, x_s = act_quant(x)
    assert x_s.shape == (8, 2) and torch.equal(x_q.float().abs().amax(-1), torch.full((8,), 448.0))
    ref = (x_q.float().view(8, 2, 128) * x_s[..., None]).view(8, 256) @ dequantize_block_fp8(q, s).t()
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
    rel = (got - x @ w.t()).norm() / (x @ w.t()).norm()
    assert 0 < rel < 0.05   # e4m3 rounding of both operands


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_hf_engine_can_run_its_linear_layers_as_fp8_gemms(dtype):
    from mrl.rollout.types import Sampling

    gemm, deq = _engine(0, dtype=dtype), _engine(0, dtype=dtype)
    gemm._fp8.scaled_mm = True   # what fp8_matmul = "scaled_mm" (or "auto" on an sm89+ GPU) sets
    assert not deq._fp8.scaled_mm   # auto on the CPU: the dequantized weights
    trainer = Trainer(gemm)
    for engine in (gemm, deq):
        ColocatedChannel(engine, verify_every_steps=1).push(trainer.stream(), 0)
    assert len(gemm._fp8.routed) == 14 and not deq._fp8.routed   # 2 layers x q, k, v, o, gate, up, down
    seqs = [[1, 5, 6, 7, 8, 9, 10], [1, 300, 301, 2]]
    a, b = gemm.sequence_logprobs(seqs), deq.sequence_logprobs(seqs)
    diffs = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    assert 0 < max(diffs) < 0.05, diffs   # only the activations' FP8 rounding differs
    out = gemm.generate([[1, 5, 6]], Sampling(n=2, temperature=1.0, max_tokens=4, seed=0))
    assert all(len(r.token_ids) == 4 for r in out)
