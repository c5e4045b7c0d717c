"""`mrl merge`: checkpoints saved at TP2 / EP2 by 2 ranks, merged in one process (slow tier), and
the one-line errors for anything that is not a complete checkpoint (fast tier)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mrl.errors import UserError
from mrl.merge.source import resolve_checkpoint
from mrl.merge.writer import INDEX_NAME, ShardWriter, parse_size
from tests.weights.archs import probe_tokens


def _read_dir(d: Path) -> dict[str, torch.Tensor]:
    index = json.loads((d / INDEX_NAME).read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        part = load_file(str(d / shard))
        assert all(index["weight_map"][k] == shard for k in part), shard
        out.update(part)
    assert set(out) == set(index["weight_map"])
    return out


def _source_weights(src: Path) -> dict[str, torch.Tensor]:
    weights = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)
    return weights


def _assert_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), f"{name} differs"


# ----------------------------------------------------------------------------- slow: real checkpoints

def _transformers_config(src):
    """The source's config as transformers builds it (an aliased kimi_k2 as deepseek_v3)."""
    from transformers import AutoConfig

    from mrl.models.facts import canonical_config

    return AutoConfig.for_model(**canonical_config(json.loads((src / "config.json").read_text())))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["q2_tp2", "moe_ep2", "q2moe_ep2", "dsv3_tp2", "kimi_ep2", "glm_tp2", "oss_ep2",
                                  "gemma_tp2", "next_tp2"])
def test_merge_is_bit_exact_and_matches_transformers(saved, tmp_path, name):
    """TP2 Qwen2 / EP2 Qwen3-MoE / EP2 Qwen2-MoE / TP2 DeepSeek-V3 / EP2 Kimi-K2 / TP2 GLM-4.5 / EP2 gpt-oss
    (its experts stacked back) / TP2 Gemma 3 text / TP2 Qwen3-Next (Gated DeltaNet in_proj and conv
    resharded by their named sections) -> HF: the
    source tensors bit for bit (DeepSeek's router correction bias included), the source model's
    logits (a Kimi-K2 source read as DeepSeek-V3, as the merged config.json says)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mrl.merge import merge

    root, src, expected = saved[name]
    out = tmp_path / "hf"
    report = merge(root, out, max_shard_size="40KB")
    got = _read_dir(out)
    _assert_equal(got, _source_weights(src))
    _assert_equal(got, expected)
    assert report.shards > 1 and report.verification.ok and report.verification.max_abs_diff <= 1e-5
    for shard in out.glob("model-*.safetensors"):   # size-bounded shards (a bigger tensor goes alone)
        part = load_file(str(shard))
        assert len(part) == 1 or sum(t.numel() * t.element_size() for t in part.values()) <= 40_000
    assert not (out.parent / "hf.partial").exists()
    tokens = probe_tokens(json.loads((src / "config.json").read_text())["vocab_size"])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(src, config=_transformers_config(src),
                                                    dtype=torch.float32).eval()(tokens).logits
        merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(tokens).logits
    assert torch.equal(merged, want)
    if (src / "tokenizer.json").is_file():
        assert AutoTokenizer.from_pretrained(out)("hi").input_ids == AutoTokenizer.from_pretrained(src)("hi").input_ids
    assert (out / "generation_config.json").read_text() == (src / "generation_config.json").read_text()


@pytest.mark.slow
def test_merge_critic_writes_value_head_apart(saved, tmp_path):
    """A TP2 critic: backbone shards without any head, `score.weight` in value_head.safetensors,
    values (base model's last hidden state x score) verified against the Megatron critic."""
    from transformers import AutoConfig

    from mrl.merge import merge

    root, src, expected = saved["q2_critic_tp2"]
    out = tmp_path / "critic"
    report = merge(root, out)
    got = _read_dir(out)
    head = load_file(str(out / "value_head.safetensors"))
    source = _source_weights(src)
    assert set(head) == {"score.weight"} and torch.equal(head["score.weight"], source.pop("score.weight"))
    assert "lm_head.weight" not in got
    _assert_equal(got, source)
    assert report.role == "critic" and report.verification.what == "values" and report.verification.ok
    assert AutoConfig.from_pretrained(out).architectures == ["Qwen2Model"]


@pytest.mark.slow
def test_merge_builtin_preset_bf16_and_cli(saved, tmp_path, capsys):
    """A bf16 builtin-preset checkpoint through `mrl merge`: bf16 shards by default, float32 on
    request (exact upcast), the byte-level tokenizer and its special-token ids."""
    from transformers import AutoConfig, AutoTokenizer

    from mrl.cli import main
    from mrl.models.tokenizer import byte_tokenizer

    root, _, expected = saved["preset_bf16_tp2"]
    assert main(["merge", str(root), str(tmp_path / "bf16")]) == 0
    assert "verified logits" in capsys.readouterr().out
    _assert_equal(_read_dir(tmp_path / "bf16"), expected)
    assert main(["merge", str(root / "step_00000010"), str(tmp_path / "fp32"), "--dtype", "float32", "--no-verify"]) == 0
    assert "not verified" in capsys.readouterr().out
    _assert_equal(_read_dir(tmp_path / "fp32"), {k: v.float() for k, v in expected.items()})
    tok = AutoTokenizer.from_pretrained(tmp_path / "bf16")
    assert tok("héllo").input_ids == byte_tokenizer()("héllo").input_ids
    cfg = AutoConfig.from_pretrained(tmp_path / "bf16")
    assert cfg.eos_token_id == tok.eos_token_id and cfg.dtype == torch.bfloat16
    assert main(["merge", str(root), str(tmp_path / "bf16")]) == 2   # output exists
    assert "already exists" in capsys.readouterr().err
    assert main(["merge", str(root), str(tmp_path / "adapter"), "--format", "peft"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: merge --format peft: checkpoint {root / 'step_00000010'} was not trained with LoRA adapters "
        "(rank 0: full weights); merge it with --format hf"]
    assert not (tmp_path / "adapter").exists()


# ----------------------------------------------------------------------------- fast: errors, writer

def _step_dir(root: Path, step: int = 5, files=("metadata.json", "common.pt", ".metadata")) -> Path:
    d = root / f"step_{step:08d}"
    d.mkdir(parents=True)
    for f in files:
        (d / f).write_text('{"sharded_backend": "torch_dist"}' if f == "metadata.json" else "x")
    return d


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("file", "is a file"),
    ("empty", "is not a checkpoint (no `latest`"),
    ("tmp_only", "only the unfinished save .tmp.step_00000007"),
    ("tmp_dir", "is an unfinished save"),
    ("dangling_latest", "names 'step_00000009', which is not a checkpoint directory"),
    ("no_metadata", "metadata.json is missing"),
    ("no_common", "common.pt is missing"),
    ("other_backend", "uses backend 'zarr'"),
])
def test_not_a_complete_checkpoint_is_one_line_error(tmp_path, case, message):
    root = tmp_path / "ckpt"
    root.mkdir()
    target = root
    if case == "missing":
        target = tmp_path / "nope"
    elif case == "file":
        target = tmp_path / "f.pt"
        target.write_text("x")
    elif case in ("tmp_only", "tmp_dir"):
        tmp = root / ".tmp.step_00000007"
        tmp.mkdir()
        target = tmp if case == "tmp_dir" else root
    elif case == "dangling_latest":
        _step_dir(root, 3)
        (root / "latest").write_text("step_00000009\n")
    elif case == "no_metadata":
        _step_dir(root, files=("common.pt", ".metadata"))
        (root / "latest").write_text("step_00000005\n")
    elif case == "no_common":
        target = _step_dir(root, files=("metadata.json", ".metadata"))
    elif case == "other_backend":
        target = _step_dir(root)
        (target / "metadata.json").write_text('{"sharded_backend": "zarr"}')
    with pytest.raises(UserError) as e:
        resolve_checkpoint(target)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_resolve_follows_latest_then_highest_step(tmp_path):
    a, b = _step_dir(tmp_path, 4), _step_dir(tmp_path, 8)
    assert resolve_checkpoint(tmp_path) == b          # no pointer: the highest complete step
    (tmp_path / "latest").write_text("step_00000004\n")
    assert resolve_checkpoint(tmp_path) == a
    assert resolve_checkpoint(b) == b


def test_cli_merge_errors_exit_2_with_one_line(tmp_path, capsys):
    from mrl.cli import main

    assert main(["merge", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: merge: {tmp_path / 'missing'} does not exist"]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    assert main(["merge", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err
    assert main(["merge", str(tmp_path), str(tmp_path / "o2"), "--max-shard-size", "lots"]) == 2
    assert "--max-shard-size" in capsys.readouterr().err


def test_peft_adapter_config_and_base():
    """PEFT's config keys for mrl's adapter settings; the base a PEFT directory names must be a
    Hugging Face checkpoint (a local directory made absolute, a Hub id as is; no builtin preset)."""
    from mrl.merge.peft import adapter_config, peft_base

    cfg = adapter_config({"rank": 8, "alpha": 16, "dropout": 0.05, "target_modules": ("q_proj", "v_proj")}, "org/base")
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"], cfg["lora_dropout"]) == ("LORA", 8, 16.0, 0.05)
    assert cfg["target_modules"] == ["q_proj", "v_proj"] and cfg["base_model_name_or_path"] == "org/base"
    assert not cfg["use_rslora"] and cfg["bias"] == "none"
    assert peft_base("Qwen/Qwen2.5-7B") == "Qwen/Qwen2.5-7B"
    assert peft_base(".") == str(Path(".").resolve())
    with pytest.raises(UserError, match="preset 'builtin:tiny-qwen2', which has no Hugging Face checkpoint"):
        peft_base("builtin:tiny-qwen2")


def test_parse_size():
    assert parse_size("2GB") == 2 * 10**9 and parse_size("1.5MiB") == int(1.5 * 2**20)
    assert parse_size("500kb") == 500_000 and parse_size("4096") == 4096 and parse_size(77) == 77
    for bad in ("", "2XB", "-1GB", "0"):
        with pytest.raises(UserError):
            parse_size(bad)


def test_shard_writer_names_index_and_views(tmp_path):
    from mrl.weights import hf_buckets

    base = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    stream = [("a", base[:2]), ("b", base[2:]), ("c", torch.ones(3)), ("d", torch.zeros(100))]
    writer = ShardWriter(tmp_path)
    for bucket in hf_buckets(iter(stream), 100):   # [a b] (views of one tensor), [c], [d]
        writer.write(bucket)
    index = writer.finish()
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index["metadata"]["total_size"] == 4 * (24 + 3 + 100)
    got = _read_dir(tmp_path)
    for name, t in stream:
        assert torch.equal(got[name], t)
    with pytest.raises(RuntimeError, match="exported twice"):
        writer.write([("a", torch.ones(1))])


def test_a_run_directory_resolves_to_its_actor_checkpoint(tmp_path):
    run = tmp_path / "quickstart-cpu"
    step = _step_dir(run / "checkpoints/actor", 4)
    _step_dir(run / "checkpoints/critic", 4)
    (run / "checkpoints/actor/latest").write_text("step_00000004\n")
    assert resolve_checkpoint(run) == step


def test_merged_files_are_readable_by_others_like_any_hf_export(tmp_path):
    import os
    import stat

    old = os.umask(0o022)
    try:
        writer = ShardWriter(tmp_path)
        writer.write([("a", torch.ones(2))])
        writer.finish()
    finally:
        os.umask(old)
    for f in tmp_path.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f
