"""Weight mapping, model roles and HF parity in one process (world 1); layouts are in the slow tier."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mrl.errors import UserError
from mrl.weights.tables import TABLES
from mrl.weights.transforms import GATE_UP, QKV_FUSED, VOCAB, ModelDims
from tests.weights.archs import ARCHS, copy_config, make_hf_model, probe_tokens


class _Mem:
    """A SliceReader over an in-memory tensor (what safetensors' get_slice gives on disk)."""

    def __init__(self, t):
        self.t, self.shape, self.name = t, tuple(t.shape), "mem"

    def rows(self, a, b):
        return self.t[a:b]

    def cols(self, a, b):
        return self.t[:, a:b]

    def all(self):
        return self.t


# ----------------------------------------------------------------------------- transforms (no megatron)

def test_qkv_layout_by_hand():
    """2 query groups x 2 heads per group, head dim 1: megatron rows are [q0 q1 k0 v0 | q2 q3 k1 v1]."""
    dims = ModelDims(num_query_groups=2, heads_per_group=2, head_dim=1, vocab_size=8)
    q, k, v = torch.tensor([[0.], [1.], [2.], [3.]]), torch.tensor([[10.], [11.]]), torch.tensor([[20.], [21.]])
    full = QKV_FUSED.shard_from_hf([_Mem(q), _Mem(k), _Mem(v)], 0, 1, 0, (8, 1), dims)
    assert full.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    r1 = QKV_FUSED.shard_from_hf([_Mem(q), _Mem(k), _Mem(v)], 1, 2, 0, (8, 1), dims)
    assert r1.flatten().tolist() == [2, 3, 11, 21]   # TP rank 1 owns query group 1
    back = QKV_FUSED.to_hf([full[:4], full[4:]], 0, dims)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_transforms_round_trip_through_tp_shards(tp):
    g = torch.Generator().manual_seed(0)
    dims = ModelDims(num_query_groups=4, heads_per_group=3, head_dim=2, vocab_size=13)
    hidden = 5
    q, k, v = (torch.randn(n, hidden, generator=g) for n in (24, 8, 8))
    shards = [QKV_FUSED.shard_from_hf([_Mem(q), _Mem(k), _Mem(v)], r, tp, 0, (40, hidden), dims) for r in range(tp)]
    assert all(torch.equal(a, b) for a, b in zip(QKV_FUSED.to_hf(shards, 0, dims), (q, k, v)))
    gate, up = torch.randn(8, hidden, generator=g), torch.randn(8, hidden, generator=g)
    shards = [GATE_UP.shard_from_hf([_Mem(gate), _Mem(up)], r, tp, 0, (16, hidden), dims) for r in range(tp)]
    assert torch.equal(shards[0][: 8 // tp], gate[: 8 // tp])   # each rank holds [gate_r; up_r]
    assert all(torch.equal(a, b) for a, b in zip(GATE_UP.to_hf(shards, 0, dims), (gate, up)))
    emb = torch.randn(13, hidden, generator=g)
    padded = 16
    shards = [VOCAB.shard_from_hf([_Mem(emb)], r, tp, 0, (padded, hidden), dims) for r in range(tp)]
    assert torch.cat(shards)[13:].abs().sum() == 0   # padding rows are zero
    assert torch.equal(VOCAB.to_hf(shards, 0, dims)[0], emb)


def test_every_table_names_each_megatron_pattern_once():
    for arch, rows in TABLES.items():
        patterns = [r.megatron for r in rows]
        assert len(patterns) == len(set(patterns)), arch
        for r in rows:
            assert len(r.hf_names) == r.transform.n_hf, (arch, r.megatron)


# ----------------------------------------------------------------------------- one process, megatron

@pytest.fixture(scope="module")
def platform():
    from mrl import platform as plat
    from mrl.platform.config import ParallelConfig, PlatformConfig

    ctx = plat.setup(PlatformConfig(device="cpu", ranks_per_node=1, cpu_threads=1), ParallelConfig(), seed=11)
    yield ctx
    plat.teardown()


def _megatron(role, d, *, dtype="float32"):
    from mrl.models.megatron import complete_hf_config
    from mrl.models.roles import build_role_model
    from mrl.platform.config import ParallelConfig
    from mrl.weights import load_hf_checkpoint

    hf = complete_hf_config(json.loads((d / "config.json").read_text()))
    model = build_role_model(role, hf, ParallelConfig(), dtype=dtype, device="cpu")
    report = load_hf_checkpoint([model], d, hf, role=role)
    return hf, model.eval(), report


def _forward(model, tokens):
    from mrl.models.megatron import position_ids

    b, s = tokens.shape
    with torch.no_grad():
        return model(tokens, position_ids(b, s), None)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_export_loads_in_transformers_with_the_same_logits(platform, tmp_path, arch):
    """HF -> Megatron -> exported stream -> a saved directory -> from_pretrained: same logits."""
    from transformers import AutoModelForCausalLM

    from mrl.weights import Exporter

    src = tmp_path / "src"
    ref_model = make_hf_model(arch, src)
    hf, model, _ = _megatron("actor", src)
    out = tmp_path / "exported"
    out.mkdir()
    from mrl.weights.stacked import stack_experts

    # gpt-oss' per-expert rows stacked back into its checkpoint's tensors (a no-op for the others)
    save_file(dict(stack_experts(Exporter([model], hf).stream(), hf)), out / "model.safetensors",
              metadata={"format": "pt"})
    copy_config(src, out)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = probe_tokens(hf["vocab_size"])
    with torch.no_grad():
        want = ref_model(tokens).logits
        got = reloaded(tokens).logits
    assert torch.equal(got, want)
    megatron_logits = _forward(model, tokens)[..., : hf["vocab_size"]]
    assert (megatron_logits - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_packed_row_logits_equal_transformers_per_sequence(platform, tmp_path, arch):
    """Sequences of mixed lengths (1-token ones included) packed into one `thd` row vs each run
    alone through `transformers`: RoPE restarts per sequence and keeps the checkpoint's scaling
    (llama3, linear), after the QK-norms on Qwen3."""
    from mrl.engine.packing import _thd_params

    ref_model = make_hf_model(arch, tmp_path)
    hf, model, _ = _megatron("actor", tmp_path)
    lengths = [9, 1, 40, 1, 3]   # 40 > llama3's original 32 positions: the scaled frequencies matter
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, hf["vocab_size"], (n,), generator=g) for n in lengths]
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with torch.no_grad():
        got = model(torch.cat(seqs).unsqueeze(0), pos, None, packed_seq_params=_thd_params(lengths, "cpu"))
        want = torch.cat([ref_model(s.unsqueeze(0)).logits[0] for s in seqs])
    assert (got[0, :, : hf["vocab_size"]] - want).abs().max().item() <= 1e-5


def test_sharded_checkpoint_with_index_and_bf16_export(platform, tmp_path):
    from transformers import AutoModelForCausalLM

    from mrl.weights import Exporter, hf_buckets

    src = tmp_path / "src"
    make_hf_model("qwen3_moe", src)
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    hf, model, report = _megatron("actor", sharded)
    assert report.tensors_read == 45
    stream = Exporter([model], hf, dtype=torch.bfloat16).stream()
    buckets = list(hf_buckets(stream, bucket_bytes=32 * 1024))
    flat = dict(kv for b in buckets for kv in b)
    assert len(flat) == 45 and all(t.dtype == torch.bfloat16 for t in flat.values())
    for b in buckets:   # a bucket exceeds the bound only when it holds one large tensor
        assert len(b) == 1 or sum(t.numel() * t.element_size() for _, t in b) <= 32 * 1024
    original = load_file(src / "model.safetensors")
    assert all(torch.equal(flat[k], v.to(torch.bfloat16)) for k, v in original.items())


@pytest.mark.parametrize("damage, message", [
    ("drop", "missing tensor 'model.layers.1.self_attn.k_proj.weight' (for decoder.layers.1.self_attention.linear_qkv.weight)"),
    ("extra", "unexpected tensor 'model.layers.9.mlp.up_proj.weight'"),
    ("shape", "tensor 'model.layers.0.mlp.down_proj.weight' has shape [64, 95], the model needs [64, 96]"),
])
def test_bad_checkpoints_name_the_tensor(platform, tmp_path, damage, message):
    make_hf_model("llama", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    if damage == "drop":
        del tensors["model.layers.1.self_attn.k_proj.weight"]
    elif damage == "extra":
        tensors["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2, 2)
    else:
        tensors["model.layers.0.mlp.down_proj.weight"] = tensors["model.layers.0.mlp.down_proj.weight"][:, :95].contiguous()
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(UserError) as e:
        _megatron("actor", tmp_path)
    assert message in str(e.value)
    assert str(e.value).startswith(f"weights: {tmp_path}: ")


def test_missing_checkpoint_files_are_user_errors(platform, tmp_path):
    make_hf_model("llama", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(UserError, match="has neither model.safetensors.index.json nor model.safetensors"):
        _megatron("actor", tmp_path)


def test_actor_logprobs_equal_log_softmax_gather(platform, tmp_path):
    from mrl.models.roles import token_logprobs

    ref_model = make_hf_model("qwen2", tmp_path)   # vocab 250, padded to 256 on the Megatron side
    hf, model, _ = _megatron("actor", tmp_path)
    tokens = probe_tokens(hf["vocab_size"])
    logits = _forward(model, tokens)
    assert logits.shape[-1] == 256
    for temperature in (1.0, 0.7):
        lp, ent = token_logprobs(logits[:, :-1], tokens[:, 1:], vocab_size=hf["vocab_size"], temperature=temperature)
        with torch.no_grad():
            want = torch.log_softmax(ref_model(tokens).logits[:, :-1] / temperature, dim=-1)
        assert (lp - want.gather(-1, tokens[:, 1:, None]).squeeze(-1)).abs().max().item() <= 1e-5
        assert (ent + (want.exp() * want).sum(-1)).abs().max().item() <= 1e-5


def test_critic_value_head_by_hand(platform, tmp_path):
    """The critic starts from a policy checkpoint: its value head keeps its init; values are the
    final normed hidden states times the head's weight, one per token."""
    ref_model = make_hf_model("llama", tmp_path)   # untied: its lm_head is present and unused
    hf, critic, report = _megatron("critic", tmp_path)
    assert report.initialised == ["0/output_layer.weight"]
    head = torch.zeros(1, hf["hidden_size"])
    head[0, 3] = 2.0
    critic.output_layer.weight.data.copy_(head)
    tokens = probe_tokens(hf["vocab_size"])
    values = _forward(critic, tokens)
    assert values.shape == (2, 12, 1)
    with torch.no_grad():
        hidden = ref_model(tokens, output_hidden_states=True).hidden_states[-1]  # after the final norm
    assert (values[..., 0] - 2.0 * hidden[..., 3]).abs().max().item() <= 1e-5


def test_reward_model_scores_the_last_token_like_transformers(platform, tmp_path):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from mrl.models.roles import last_token_values
    from mrl.weights import Exporter

    cfg = AutoConfig.for_model(**{**__import__("tests.weights.archs", fromlist=["_COMMON"])._COMMON,
                                  **ARCHS["qwen2"], "num_labels": 1, "pad_token_id": 0})
    torch.manual_seed(3)
    rm = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32).eval()
    rm.save_pretrained(tmp_path)
    hf, model, _ = _megatron("reward", tmp_path)
    tokens = probe_tokens(hf["vocab_size"]).clamp(min=1)
    tokens[0, 9:] = 0   # right padding
    mask = (tokens != 0).long()
    scores = last_token_values(_forward(model, tokens), mask)
    with torch.no_grad():
        want = rm(tokens).logits[:, 0]
    assert scores.shape == (2,)
    assert (scores - want).abs().max().item() <= 1e-5
    exported = dict(Exporter([model], hf).stream())
    assert torch.equal(exported["score.weight"], rm.score.weight)


def test_last_token_values_handles_left_and_right_padding():
    from mrl.models.roles import last_token_values

    values = torch.arange(12.).view(2, 6, 1)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    assert last_token_values(values, mask).tolist() == [4.0, 11.0]
    with pytest.raises(ValueError, match="no tokens"):
        last_token_values(values, torch.zeros(2, 6))


def test_reference_role_is_frozen(platform, tmp_path):
    make_hf_model("llama", tmp_path)
    _, ref, _ = _megatron("ref", tmp_path)
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())


def test_export_benchmark_runs():
    """tools/bench/weights.py at toy size: it must run and print the side-by-side ratio."""
    import re
    import subprocess
    import sys

    from tests.dist_util import REPO

    proc = subprocess.run([sys.executable, str(REPO / "tools/bench/weights.py"), "--hidden", "64", "--ffn", "128",
                           "--layers", "2", "--heads", "4", "--kv-heads", "2", "--vocab", "512", "--iters", "1",
                           "--dtype", "bf16", "--bucket-mb", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"export .* GB/s", proc.stdout) and re.search(r"copy .* GB/s", proc.stdout), proc.stdout
    assert re.search(r"ratio export/copy throughput: \d+\.\d\d", proc.stdout), proc.stdout


def test_qwen3_moe_with_dense_layers_round_trips(platform, tmp_path):
    """`mlp_only_layers` keeps a dense MLP in layer 0: both row groups of the table apply."""
    from mrl.weights import Exporter

    ref_model = make_hf_model("qwen3_moe", tmp_path, mlp_only_layers=[0])
    hf, model, _ = _megatron("actor", tmp_path)
    assert hasattr(model.decoder.layers[0].mlp, "linear_fc1") and hasattr(model.decoder.layers[1].mlp, "router")
    exported = dict(Exporter([model], hf).stream())
    original = load_file(tmp_path / "model.safetensors")
    assert set(exported) == set(original) and all(torch.equal(exported[k], v) for k, v in original.items())
    tokens = probe_tokens(hf["vocab_size"])
    with torch.no_grad():
        want = ref_model(tokens).logits
    assert (_forward(model, tokens)[..., : hf["vocab_size"]] - want).abs().max().item() <= 1e-5


def test_unsupported_rope_and_architecture_are_user_errors():
    from mrl.models.megatron import complete_hf_config, hf_inv_freq

    with pytest.raises(UserError, match="model_type 'gpt2' is not supported"):
        complete_hf_config({"model_type": "gpt2"})
    cfg = complete_hf_config({**ARCHS["qwen2"], "hidden_size": 64, "num_attention_heads": 4,
                              "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}})
    with pytest.raises(UserError, match="RoPE type 'dynamic' is not supported"):
        hf_inv_freq(cfg)


def test_deepseek_v3_yarn_rope_and_no_q_bottleneck_match_transformers(platform, tmp_path):
    """DeepSeek-V3's published RoPE is yarn (factor 40, mscale_all_dim 1: cos/sin and the softmax
    scale both carry the mscale); packed sequences longer than the original positions; and MLA
    without a q bottleneck (`q_lora_rank` null: one `q_proj`, as in DeepSeek-V2-Lite)."""
    from mrl.engine.packing import _thd_params

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    for i, overrides in enumerate([dict(rope_parameters=yarn), dict(q_lora_rank=None)]):
        d = tmp_path / str(i)
        ref_model = make_hf_model("deepseek_v3", d, **overrides)
        hf, model, _ = _megatron("actor", d)
        lengths = [30, 1, 7]
        g = torch.Generator().manual_seed(5)
        seqs = [torch.randint(0, hf["vocab_size"], (n,), generator=g) for n in lengths]
        pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        with torch.no_grad():
            got = model(torch.cat(seqs).unsqueeze(0), pos, None, packed_seq_params=_thd_params(lengths, "cpu"))
            want = torch.cat([ref_model(s.unsqueeze(0)).logits[0] for s in seqs])
        assert (got[0, :, : hf["vocab_size"]] - want).abs().max().item() <= 1e-5, overrides


def test_lora_on_mla_refuses_q_k_v_and_adapts_o_proj(platform, tmp_path):
    """deepseek_v3 has no q/k/v projections to adapt: one line naming them, not a silent skip."""
    from mrl.models.lora import LoraConfig, apply_lora

    make_hf_model("deepseek_v3", tmp_path)
    _, model, _ = _megatron("actor", tmp_path)
    with pytest.raises(UserError, match=r"target_modules \['q_proj', 'v_proj'\] on multi-latent attention"):
        apply_lora(model, LoraConfig(rank=4, target_modules=("q_proj", "v_proj", "o_proj")))
    apply_lora(model, LoraConfig(rank=4, target_modules=("o_proj",)))
    assert sorted(n for n, p in model.named_parameters() if p.requires_grad) == [
        f"decoder.layers.{i}.self_attention.linear_proj.lora.{m}.o_proj" for i in (0, 1) for m in "AB"]


def test_deepseek_v3_refusals_are_one_line():
    from mrl.models.megatron import complete_hf_config, deepseek_v3_fields
    from tests.weights.archs import _COMMON

    hf = complete_hf_config({**_COMMON, **ARCHS["deepseek_v3"]})
    assert deepseek_v3_fields(hf)["moe_router_num_groups"] == 4
    for bad, message in [(dict(rope_interleave=False), "rope_interleave = false is not supported"),
                         (dict(norm_topk_prob=False), "norm_topk_prob = false is not supported"),
                         (dict(num_experts_per_tok=3), "needs num_experts_per_tok = 2 x topk_group"),
                         (dict(_tensor_parallel=3), "parallel.tensor: 3 does not divide deepseek_v3's q_lora_rank")]:
        with pytest.raises(UserError, match=message):
            deepseek_v3_fields({**hf, **bad})


def test_every_supported_model_type_has_a_tested_tiny_model():
    """`mrl keys model` lists facts.ARCHITECTURES with tested layouts: each has a model in
    tests/weights/archs.py (hence the TP1 checks here and the layouts launch), mistral apart
    (llama's table and translation, said in its entry) and the multimodal Qwen3.5 types apart (their
    own tests/weights/test_qwen3_5_vlm.py)."""
    from mrl.models.facts import ARCHITECTURES

    assert set(ARCHITECTURES) - {"mistral", "qwen3_5", "qwen3_5_moe"} == set(ARCHS)
    assert "no test of its own" in ARCHITECTURES["mistral"]



def test_multi_token_prediction_layers_are_skipped_only_where_the_config_declares_them(platform, tmp_path):
    """GLM-4.5 / DeepSeek-V3 checkpoints store `num_nextn_predict_layers` MTP layers after the last
    one (`model.layers.<num_hidden_layers>.*`): not loaded (transformers skips them too), counted in
    the report; the same tensors without the config field are an unexpected-tensor error."""
    ref_model = make_hf_model("glm4_moe", tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    mtp = {k.replace("model.layers.1.", "model.layers.2."): v.clone() for k, v in weights.items()
           if k.startswith("model.layers.1.")}
    save_file({**weights, **mtp}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    for declared in (1, 0):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": declared}))
        if not declared:
            with pytest.raises(UserError, match=r"unexpected tensor 'model\.layers\.2\..*\(and \d+ more\)"):
                _megatron("actor", tmp_path)
            continue
        hf, model, report = _megatron("actor", tmp_path)
        assert report.mtp_skipped == len(mtp) > 0 and report.tensors_read > 0
        tokens = probe_tokens(hf["vocab_size"])
        with torch.no_grad():
            want = ref_model(tokens).logits
        assert (_forward(model, tokens)[..., : hf["vocab_size"]] - want).abs().max().item() <= 1e-5
