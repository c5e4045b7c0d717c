"""The attention seam (`mrl.models.attention`): backends against a dense reference, the rules of
`model.attention`, norms in the model dtype, and memory linear in the packed row."""
from __future__ import annotations

import pytest
import torch

from mrl.errors import UserError
from mrl.models import attention as attn
from mrl.platform.config import ParallelConfig, PlatformConfig


def _dense_reference(q, k, v, lengths, scale):
    """Block-diagonal causal attention with an explicit [T, T] mask (fp64 math)."""
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.as_tensor(lengths))
    ar = torch.arange(len(seg))
    allowed = (seg.unsqueeze(0) == seg.unsqueeze(1)) & (ar.unsqueeze(1) >= ar.unsqueeze(0))  # [q, k]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_sdpa_packed_equals_dense_block_causal_attention_and_its_gradients(kv_heads):
    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 9, 9, 3]  # equal lengths, a 1-token sequence
    t = sum(lengths)
    q = torch.randn(t, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(t, kv_heads, 8, generator=g, requires_grad=True)
    v = torch.randn(t, kv_heads, 8, generator=g, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    w = torch.randn(t, 4, 8, generator=g)
    got = attn.sdpa_packed(q, k, v, cu, 0.3)
    (got * w).sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    want = _dense_reference(q, k, v, lengths, 0.3)
    (want * w).sum().backward()
    assert (got.double() - want).abs().max() < 1e-5
    for mine, ref in zip(grads, (q.grad, k.grad, v.grad)):
        assert (mine - ref).abs().max() < 1e-5
    # the check can fail: one sequence boundary moved changes the result
    moved = attn.sdpa_packed(q, k, v, torch.tensor([0, 6, 6, 15, 24, 27], dtype=torch.int32), 0.3)
    assert (moved.double() - want).abs().max() > 1e-2


def test_backend_rules_are_one_place_and_name_the_key():
    assert attn.resolve_backend("auto", "cpu") == "sdpa"
    assert attn.resolve_backend("auto", "cuda") == ("te" if attn.te_available() else "varlen")
    for backend in ("varlen", "flex"):
        with pytest.raises(UserError, match=rf"model.attention: '{backend}' runs on CUDA only"):
            attn.resolve_backend(backend, "cpu")
    if not attn.te_available():
        with pytest.raises(UserError, match="model.attention: 'te' needs .*Transformer Engine"):
            attn.resolve_backend("te", "cuda")
    with pytest.raises(UserError, match="unknown backend"):
        attn.resolve_backend("dense", "cpu")


def test_validate_refuses_a_backend_the_device_cannot_run():
    from mrl.config.loader import load
    from mrl.errors import SpecError

    with pytest.raises(SpecError, match=r"model.attention: 'varlen' runs on CUDA only"):
        load("jobs/quickstart_cpu.toml", ["model.attention=varlen"])


@pytest.fixture
def cpu_platform():
    from mrl import platform

    with platform.setup(PlatformConfig(device="cpu", ranks_per_node=1, cpu_threads=1), ParallelConfig(), seed=3):
        yield


def _tiny_hf(**kw):
    return dict(model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32768,
                tie_word_embeddings=False, **kw)


def test_a_bf16_model_holds_no_fp32_parameter_and_its_norms_run_in_bf16(cpu_platform):
    """megatron's torch norm is built in fp32 whatever the model dtype; mrl's norms (including
    Qwen3's QK-norms) take the model dtype, so a bf16 model is bf16 throughout."""
    from mrl.models.megatron import build_gpt, transformer_config

    hf = _tiny_hf()
    cfg = transformer_config(hf, dtype="bfloat16", parallel=ParallelConfig(), device="cpu")
    model = build_gpt(hf, cfg)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert any("q_layernorm" in n for n in dtypes) and any("final_layernorm" in n for n in dtypes)
    assert set(dtypes.values()) == {torch.bfloat16}, {n: d for n, d in dtypes.items() if d != torch.bfloat16}
    assert model.mrl_attention == "sdpa"


def _packed_forward_backward(model, lengths: list[int], vocab: int):
    from mrl.engine.packing import _thd_params

    tokens = torch.randint(0, vocab, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    out = model(tokens, pos, None, packed_seq_params=_thd_params(lengths, "cpu"))
    out.float().square().mean().backward()
    return out


def test_packed_forward_matches_megatrons_dense_mask_path(cpu_platform):
    """One packed row through the model: mrl's sdpa backend vs megatron's unfused attention with
    the dense block-causal mask, logits and gradients (fp32)."""
    from mrl.models.megatron import build_gpt, transformer_config
    from mrl.models.tiny_model import block_causal_mask

    hf = _tiny_hf()
    cfg = transformer_config(hf, dtype="float32", parallel=ParallelConfig(), device="cpu")
    torch.manual_seed(0)
    ref = build_gpt(hf, cfg, attention="reference")
    packed = build_gpt(hf, cfg)
    packed.load_state_dict(ref.state_dict())
    lengths = [7, 3, 12, 1]
    got = _packed_forward_backward(packed, lengths, hf["vocab_size"])
    tokens = torch.randint(0, hf["vocab_size"], (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    want = ref(tokens, pos, block_causal_mask(lengths))
    want.float().square().mean().backward()
    assert (got - want).abs().max() < 1e-5
    worst = max((p.grad - q.grad).abs().max().item() for p, q in zip(packed.parameters(), ref.parameters()))
    assert worst < 1e-5, worst


def test_memory_of_a_packed_micro_batch_is_linear_in_its_tokens(cpu_platform):
    """A 16k-token micro-batch (8 sequences of 2048) forward + backward: the peak of tensors alive
    at once grows 4x from 4k to 16k tokens (a [T, T] mask or score matrix would grow 16x; at 16k
    tokens one fp32 [T, T] matrix alone is 1 GiB)."""
    from mrl.models.megatron import build_gpt, transformer_config
    from mrl_kernels.memtrack import PeakMemory

    hf = _tiny_hf()
    cfg = transformer_config(hf, dtype="float32", parallel=ParallelConfig(), device="cpu")
    model = build_gpt(hf, cfg)
    peaks = {}
    for tokens in (4096, 16384):
        model.zero_grad(set_to_none=True)
        with PeakMemory("cpu") as pm:
            _packed_forward_backward(model, [tokens // 8] * 8, hf["vocab_size"])
        peaks[tokens] = pm.peak
    ratio = peaks[16384] / peaks[4096]
    print(f"peak {peaks[4096] / 2**20:.1f} MiB at 4k tokens, {peaks[16384] / 2**20:.1f} MiB at 16k ({ratio:.2f}x)")
    assert ratio < 4.5, peaks
    assert peaks[16384] < 16384 ** 2 * 4 / 4, peaks  # under a quarter of one fp32 [T, T] matrix


def test_bf16_model_tracks_the_fp32_model_within_bf16_rounding(cpu_platform):
    """The same weights in bf16 and fp32 through the packed path: per-token log-probs agree within
    0.05 nats (bf16 keeps 8 bits of mantissa; measured 0.014 here, KL 1e-5), and the comparison is
    not vacuous (the log-probs are far from uniform)."""
    from mrl.models.megatron import build_gpt, transformer_config

    hf = _tiny_hf()
    torch.manual_seed(0)
    f32 = build_gpt(hf, transformer_config(hf, dtype="float32", parallel=ParallelConfig(), device="cpu"))
    b16 = build_gpt(hf, transformer_config(hf, dtype="bfloat16", parallel=ParallelConfig(), device="cpu"))
    with torch.no_grad():
        for (n, p), (m, q) in zip(f32.named_parameters(), b16.named_parameters()):
            assert n == m
            if "layernorm" not in n:
                p.mul_(4.0)  # sharper than init so the logits carry signal
            q.copy_(p)
    lengths = [40, 9, 64]
    want = _packed_forward_backward(f32, lengths, hf["vocab_size"]).float().log_softmax(-1)
    got = _packed_forward_backward(b16, lengths, hf["vocab_size"]).float().log_softmax(-1)
    diff = (got - want).abs().max().item()
    print(f"bf16 vs fp32 log-probs: max abs {diff:.4f}")
    assert diff < 0.05
    assert (want.max(-1).values - want.min(-1).values).min() > 0.5


# --------------------------------------------------------------------------------- packed RoPE

def _rope_table(max_len: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """megatron's RoPE table layout `[max_len, 1, 1, dim]`: angles, the two halves repeated."""
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]


def test_packed_positions_restart_at_every_sequence():
    from mrl.models.rope import packed_positions

    cu = torch.tensor([0, 3, 3, 4, 6], dtype=torch.int32)  # lengths 3, 0, 1, 2
    assert packed_positions(cu, 6).tolist() == [0, 1, 2, 0, 0, 1]


def test_packed_rope_equals_megatrons_per_sequence_thd_rope_and_its_gradients():
    """One rotation over the row with per-token tables vs megatron's unfused `thd` RoPE (a split
    per sequence): outputs and input gradients in fp32, mixed lengths with 1-token sequences."""
    from mrl.models.rope import packed_positions, per_sequence_rope_reference, rope_tables, rotate

    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 9, 1, 17, 3, 1, 8]
    t, heads, dim = sum(lengths), 4, 16
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    freqs = _rope_table(max(lengths), dim)
    x = torch.randn(t, heads, dim, generator=g, requires_grad=True)
    w = torch.randn(t, heads, dim, generator=g)
    want = per_sequence_rope_reference(x, cu, freqs)
    (want * w).sum().backward()
    want_grad, x.grad = x.grad.clone(), None
    got = rotate(x, *rope_tables(freqs, packed_positions(cu, t), torch.float32))
    (got * w).sum().backward()
    assert (got - want).abs().max() <= 1e-6
    assert (x.grad - want_grad).abs().max() <= 1e-6
    # the check can fail: positions that do not restart per sequence rotate differently
    flat = rotate(x, *rope_tables(_rope_table(t, dim), torch.arange(t), torch.float32))
    assert (flat - want).abs().max() > 1e-1


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_packed_rope_model_equals_megatrons_per_sequence_rope_path(cpu_platform, monkeypatch, model_type):
    """The whole model on one packed row: mrl's attention (`PackedRopeSelfAttention`) vs the same
    weights through megatron's `SelfAttention` and its per-sequence `thd` RoPE, logits and
    parameter gradients in fp32 (Qwen3: RoPE after the QK-norms; Llama with llama3 RoPE scaling).
    Only the old path runs megatron's per-sequence RoPE."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.attention import SelfAttention

    from mrl.models import rope
    from mrl.models.megatron import build_gpt, transformer_config

    extra = {} if model_type == "qwen3" else dict(
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8))
    hf = dict(_tiny_hf(), model_type=model_type, **extra)
    cfg = transformer_config(hf, dtype="float32", parallel=ParallelConfig(), device="cpu")
    torch.manual_seed(0)
    new = build_gpt(hf, cfg)
    with monkeypatch.context() as m:
        m.setattr(rope, "PackedRopeSelfAttention", SelfAttention)
        old = build_gpt(hf, cfg)
    old.load_state_dict(new.state_dict())
    assert type(new.decoder.layers[0].self_attention) is rope.PackedRopeSelfAttention
    assert type(old.decoder.layers[0].self_attention) is SelfAttention
    with torch.no_grad():  # sharper than init, so positions move the logits visibly
        for p in new.parameters():
            p.mul_(3.0)
        for p, q in zip(new.parameters(), old.parameters()):
            q.copy_(p)

    calls = []
    per_sequence = rope_utils._apply_rotary_pos_emb_thd
    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_thd", lambda *a, **k: calls.append(1) or per_sequence(*a, **k))
    lengths = [7, 1, 12, 1, 3, 1, 9]
    got = _packed_forward_backward(new, lengths, hf["vocab_size"])
    assert calls == []
    want = _packed_forward_backward(old, lengths, hf["vocab_size"])
    assert len(calls) == 2 * hf["num_hidden_layers"]  # q and k, every layer
    assert (got - want).abs().max() <= 1e-6, (got - want).abs().max()
    worst = max((p.grad - q.grad).abs().max().item() for p, q in zip(new.parameters(), old.parameters()))
    assert worst <= 1e-6, worst
    assert (want[0, 1:] - want[0, :-1]).abs().max() > 1e-2  # not vacuous: the tokens differ


def test_packed_rope_tables_are_built_once_per_micro_batch(cpu_platform, monkeypatch):
    """Every layer, the forward and the full-recompute replay (which hands each layer a detached
    copy of the RoPE table) share one set of per-token tables per micro-batch."""
    from mrl.engine.packing import _thd_params
    from mrl.models import rope
    from mrl.models.megatron import build_gpt, transformer_config

    hf = _tiny_hf()
    model = build_gpt(hf, transformer_config(hf, dtype="float32", parallel=ParallelConfig(), device="cpu",
                                             recompute="full"))
    built = []
    tables = rope.rope_tables
    monkeypatch.setattr(rope, "rope_tables", lambda *a: built.append(1) or tables(*a))
    lengths = [4, 1, 6]
    packed = _thd_params(lengths, "cpu")
    tokens = torch.randint(0, hf["vocab_size"], (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    model(tokens, pos, None, packed_seq_params=packed).square().mean().backward()
    assert len(built) == 1
    model(tokens, pos, None, packed_seq_params=_thd_params(lengths, "cpu")).square().mean().backward()
    assert len(built) == 2  # a new micro-batch, new tables
