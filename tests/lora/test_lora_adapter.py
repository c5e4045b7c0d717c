"""Starting from a saved PEFT adapter directory (`actor.lora.adapter_path`, verl's `lora_adapter_path`)."""
from __future__ import annotations

import json

import pytest
import torch

from mrl.models.lora_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _adapter_dir(path, **config):
    """A PEFT directory as `save_pretrained` writes it (the tensors are not read by the checks here)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": TARGETS, "use_dora": False,
           "use_rslora": False, "bias": "none", "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None,
           "layers_to_transform": None, **config}
    (path / ADAPTER_CONFIG).write_text(json.dumps(cfg))
    save_file({"x": torch.zeros(1)}, str(path / ADAPTER_WEIGHTS))
    return path


@pytest.mark.parametrize("lora, config, line", [
    ({"rank": 8, "alpha": 8.0}, {}, "actor.lora.rank: 8, but the adapter at {dir} has r = 4"),
    ({"rank": 4, "alpha": 16.0}, {}, "actor.lora.alpha: 16, but the adapter at {dir} has lora_alpha = 8"),
    ({"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}, {},
     "actor.lora.target_modules: ['q_proj', 'v_proj'] differ from the adapter's"),
    ({"rank": 4, "alpha": 8.0}, {"target_modules": "all-linear"},
     "actor.lora.target_modules: the adapter at {dir} names its modules by the pattern 'all-linear'"),
    ({"rank": 4, "alpha": 8.0}, {"use_dora": True}, "actor.lora.adapter_path: {dir}: use_dora = True"),
    ({"rank": 0}, {}, "actor.lora.adapter_path: starts adapters from {dir}, but actor.lora.rank is 0"),
])
def test_a_mismatched_adapter_is_one_line_naming_the_key(tmp_path, write_job, cli, lora, config, line):
    adapter = _adapter_dir(tmp_path / "adapter", **config)
    rc, _, err = cli("validate", write_job({"actor": {"lora": {**lora, "adapter_path": str(adapter)}}}))
    assert rc == 2 and line.format(dir=adapter) in err, err
    assert len([x for x in err.splitlines() if x.startswith("error:")]) == 1, err


def test_an_agreeing_adapter_validates_and_paths_resolve_against_the_job_file(tmp_path, write_job, cli):
    _adapter_dir(tmp_path / "adapter")
    job = write_job({"actor": {"lora": {"rank": 4, "alpha": 8.0, "adapter_path": "adapter"}}})
    rc, out, err = cli("validate", job)
    assert rc == 0, err
    rc, out, _ = cli("show", job, "--get", "actor.lora.adapter_path")
    assert out.strip().strip('"') == str(tmp_path / "adapter")


def test_a_missing_adapter_is_a_warning_and_a_file_without_weights_an_error(tmp_path, write_job, cli):
    rc, _, err = cli("validate", write_job({"actor": {"lora": {"rank": 4, "adapter_path": str(tmp_path / "no")}}}))
    assert rc == 0 and "does not exist on this machine" in err, err
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / ADAPTER_CONFIG).write_text(json.dumps({"r": 4, "lora_alpha": 16, "target_modules": TARGETS}))
    rc, _, err = cli("validate", write_job({"actor": {"lora": {"rank": 4, "adapter_path": str(tmp_path / "bare")}}}))
    assert rc == 2 and f"has no {ADAPTER_WEIGHTS}" in err, err


def test_an_sft_job_checks_its_adapter_the_same_way(tmp_path, cli):
    from tests.sft.conftest import sft_job, write_parquet

    adapter = _adapter_dir(tmp_path / "adapter")
    train = write_parquet(tmp_path / "pairs.parquet", [{"prompt": "2+2=", "response": "4"}] * 4)
    job = sft_job(tmp_path, "builtin:tiny-qwen2", train, extra=f'[sft.lora]\nrank = 8\nadapter_path = "{adapter}"\n')
    rc, _, err = cli("validate", job)
    assert rc == 2 and f"sft.lora.rank: 8, but the adapter at {adapter} has r = 4" in err, err


def test_verl_lora_adapter_path_converts(tmp_path):
    from mrl.convert import convert

    _adapter_dir(tmp_path / "adapter")
    conv = convert([], ["actor_rollout_ref.model.lora_rank=4", f"actor_rollout_ref.model.lora_adapter_path={tmp_path}/adapter"],
                   base=tmp_path)
    assert conv.values["actor.lora.adapter_path"].value == f"{tmp_path}/adapter"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_training_starts_from_a_peft_adapter_with_its_logits(tmp_path, write_job, dtype):
    """A PEFT adapter (random A and B) saved from a tiny Qwen2 by peft itself; mrl's actor built from
    the job (`train.build._trainable`: base weights, adapters, the saved adapter) gives the PEFT
    model's logits at step 0 (fp32: <= 1e-5; bf16: the adapter tensors hold the saved values rounded to
    bf16 (compared tensor by tensor through their absolute sums), and the logits are the fp32 PEFT model's within bf16 rounding); a job whose
    rank disagrees is refused at build too."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from mrl.config.loader import load
    from mrl.errors import UserError
    from mrl.merge.model import single_process_platform
    from mrl.models.megatron import gather_vocab_parallel_logits, hf_config, position_ids
    from mrl.train.build import _trainable
    from mrl.weights.layout import unwrap
    from tests.weights.archs import make_hf_model, probe_tokens

    hf_dir, adapter = tmp_path / "qwen2", tmp_path / "adapter"
    make_hf_model("qwen2", hf_dir)
    torch.manual_seed(3)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                                LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    peft_model.save_pretrained(adapter)
    tokens = probe_tokens(peft_model.config.vocab_size)
    with torch.no_grad():
        expected = peft_model.eval()(tokens).logits
        with peft_model.disable_adapter():
            base = peft_model(tokens).logits
    assert (expected - base).abs().max() > 0.05   # the adapter changes the model

    job = write_job({"platform": {"ranks_per_node": 1}, "parallel": {"distributed_optimizer": False},
                     "model": {"path": str(hf_dir), "dtype": dtype},
                     "actor": {"lora": {"rank": 4, "alpha": 8.0, "adapter_path": str(adapter)}}})
    spec, _ = load(job)
    hf = hf_config(spec.model)
    with single_process_platform(seed=spec.job.seed):
        actor = _trainable("actor", spec, hf, "cpu", spec.actor, 1, path=spec.model.path)
        model = unwrap(actor.chunks[0])
        with torch.no_grad():
            got = gather_vocab_parallel_logits(model(tokens, position_ids(*tokens.shape), None))
        got = got[..., :hf["vocab_size"]].float()
        if dtype == "float32":
            assert (got - expected).abs().max() <= 1e-5, (got - expected).abs().max()
        else:
            from safetensors.torch import load_file

            saved = {k.split("base_model.model.")[-1].replace(".weight", ""): v
                     for k, v in load_file(adapter / "adapter_model.safetensors").items()}
            held = {n: p for n, p in model.named_parameters() if "lora" in n.lower() or "adapter" in n.lower()}
            assert held and all(p.dtype == torch.bfloat16 for p in held.values())
            assert sorted(round(float(v.to(torch.bfloat16).float().abs().sum()), 2) for v in saved.values()) == \
                sorted(round(float(p.detach().float().abs().sum()), 2) for p in held.values())
            bf16_err = (got - expected).abs().max() / expected.abs().max()
            assert bf16_err <= 0.03, bf16_err   # measured 0.016; without the adapter 1.15
        # the tensors are checked too: an adapter of another rank cannot load
        (adapter / ADAPTER_CONFIG).write_text((adapter / ADAPTER_CONFIG).read_text().replace('"r": 4', '"r": 8'))
        wrong = spec.actor.lora.__class__(**{**spec.actor.lora.__dict__, "rank": 8})
        with pytest.raises(UserError, match=r"actor.lora.adapter_path|shape"):
            _trainable("actor", spec, hf, "cpu", type(spec.actor)(**{**spec.actor.__dict__, "lora": wrong}), 1,
                       path=spec.model.path)
