"""LoRA adapters: B = 0 is the base, gradients only in adapters, TP2 = TP1, merged export = the
adapted model, reference = base; the spec rules; a LoRA GRPO job end to end; adapters-only
checkpoints merged into full Hugging Face weights."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from tests.dist_util import REPO, run_torchrun

SCRIPT = REPO / "tests/lora/scripts/lora_check.py"
ENV = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}


def _result(stdout: str) -> dict:
    return json.loads(re.search(r"^RESULT (.*)$", stdout, re.M).group(1))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tests.weights.archs import make_hf_model

    out = tmp_path_factory.mktemp("lora") / "qwen2"   # vocab 250: Megatron pads it, tied embeddings
    make_hf_model("qwen2", out)
    return out


@pytest.mark.slow
def test_adapters_at_tp1_and_tp2(hf_dir, tmp_path):
    """The script asserts B = 0 => base logits exactly and gradients only in adapters; here: merged
    export vs Megatron logits, the PEFT adapter directory loaded by peft vs Megatron logits (each
    layout writes its own, gathered over its TP), reference vs base log-probs, and TP2 = TP1
    (logits, adapter grads)."""
    one = subprocess.run([sys.executable, str(SCRIPT), str(hf_dir), str(tmp_path)], cwd=REPO, env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-4000:]
    two = run_torchrun(SCRIPT, str(hf_dir), str(tmp_path), "--tensor", "2")
    for r in (_result(one.stdout), _result(two.stdout)):
        assert r["merged_vs_megatron"] <= 1e-5, r
        assert r["peft_vs_megatron"] <= 1e-5, r
        assert r["ref_vs_base_logprobs"] == 0.0, r
        assert r["adapted_vs_base"] > 0.1 and r["actor_vs_base_logprobs"] > 0.01, r   # the adapters act
    tp1, tp2 = torch.load(tmp_path / "tp1.pt"), torch.load(tmp_path / "tp2.pt")
    assert (tp1["logits"] - tp2["logits"]).abs().max() <= 1e-5
    assert set(tp1["grads"]) == set(tp2["grads"]) and len(tp1["grads"]) == 28   # 2 layers x 7 modules x (A, B)
    for name, g in tp1["grads"].items():
        assert torch.allclose(g, tp2["grads"][name], atol=1e-6, rtol=1e-4), name


def test_lora_spec_rules(write_job):
    from mrl.config.loader import load
    from mrl.errors import SpecError

    job = write_job({"actor": {"lora": {"rank": 8}}})
    spec, _ = load(job)
    assert spec.actor.lora.rank == 8 and spec.actor.lora.target_modules[0] == "q_proj"
    with pytest.raises(SpecError) as e:
        load(job, ["actor.lora.target_modules=[\"q_proj\",\"qkv\"]"])
    assert "actor.lora.target_modules" in e.value.problems[0]
    with pytest.raises(SpecError) as e:
        load(job, ["algorithm.kl_loss.enable=true", "ref.model_path=builtin:tiny-llama"])
    assert any("ref.model_path: with actor.lora the reference is the actor's base" in p for p in e.value.problems)
    with pytest.raises(SpecError) as e:
        load(job, ["model.path=builtin:tiny-qwen3-moe", "actor.lora.target_modules=[\"q_proj\",\"up_proj\"]",
                   "parallel.tensor=1"])
    assert any("up_proj on a mixture-of-experts model" in p for p in e.value.problems)
    with pytest.raises(SpecError) as e:
        load(job, ["actor.lora.target_modules=[]"])
    assert any("actor.lora.target_modules: is empty" in p for p in e.value.problems)


@pytest.mark.slow
def test_lora_grpo_job_learns_syncs_merged_weights_and_checkpoints_only_adapters(tmp_path):
    """jobs/grpo_lora_cpu.toml as shipped (TP=2, 20 steps): the reward rises through the adapters
    alone (measured 0.03 -> 0.92; here: step 1 <= 0.1 and the first 3 steps' mean <= 0.2, the last
    5 steps' mean >= 0.8), the policy moves away from the reference (KL > 0), the rollout engine's
    log-probs equal the trainer's every step up to round-off (the merged weights it received are
    the adapted model), and the checkpoint holds adapters only. The syncs are deltas: after the
    first (full) one, only the merged projections whose adapters moved are sent; the embedding,
    the norms and the projections' biases (frozen, not adapted) never again."""
    from mrl.merge.source import _model_tensors, resolve_checkpoint

    from tests.dist_util import free_port
    from tests.sft.test_sft import history

    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         "-m", "mrl", "train", "jobs/grpo_lora_cpu.toml", f"job.output_dir={tmp_path}", "checkpoint.every_steps=20",
         "tracking.backends=[\"mlflow\"]", "rollout.weight_sync.mode=delta"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    h = history(tmp_path / "grpo-lora-cpu")
    reward = [h["reward/mean"][s] for s in range(1, 21)]
    assert reward[0] <= 0.1 and sum(reward[:3]) / 3 <= 0.2 and sum(reward[-5:]) / 5 >= 0.8, reward
    assert all(h["actor/kl_loss"][s] > 1e-3 for s in range(2, 21)), h["actor/kl_loss"]
    # fp32 round-off, scaled by 1 / temperature (3.3x) and by the logits' size as the policy sharpens:
    # the mean stays ~3e-7 (<= 2.5e-6 at the steepest steps), single tokens reach ~2e-4 (a stale or
    # wrong sync differs by orders of magnitude more)
    assert all(v <= 1e-5 for v in h["rollout/logprob_abs_diff_mean"].values()), h["rollout/logprob_abs_diff_mean"]
    assert all(v <= 1e-3 for v in h["rollout/logprob_abs_diff_max"].values()), h["rollout/logprob_abs_diff_max"]
    sent = h["weight_sync/tensors_sent"]
    from mrl.models.facts import BUILTIN_PRESETS

    layers = BUILTIN_PRESETS["tiny-qwen2"]["num_hidden_layers"]   # the quickstart's model
    assert h["weight_sync/full"] == {s: float(s == 1) for s in range(1, 21)}, h["weight_sync/full"]
    # 7 adapted projections per layer; the other tensors (embedding, norms, q/k/v biases) only at step 1
    assert sent[1] > 7 * layers and all(0 < sent[s] <= 7 * layers for s in range(2, 21)), sent
    ckpt = resolve_checkpoint(tmp_path / "grpo-lora-cpu/checkpoints/actor")
    keys = list(_model_tensors(ckpt))
    assert keys and all(".lora." in k for k in keys), [k for k in keys if ".lora." not in k][:3]


@pytest.mark.slow
def test_lora_quickstart_temperature_is_what_lets_the_frozen_head_reach_digits():
    """Why jobs/grpo_lora_cpu.toml samples at temperature 0.3: LoRA leaves the tied embedding (the LM
    head) and the final norm frozen, so the logits are (a vector of norm sqrt(hidden) x the norm's
    weight) @ the head. Maximised over every direction of the final hidden state, P(digit) stays
    below 0.1 at temperature 1.0 and exceeds 0.85 at the job's temperature."""
    from mrl.config.loader import load
    from mrl.merge.model import single_process_platform
    from mrl.models.megatron import hf_config
    from mrl.models.roles import build_role_model
    from mrl.platform.config import ParallelConfig

    spec, _ = load(REPO / "jobs/grpo_lora_cpu.toml")
    assert spec.actor.lora.rank > 0
    with single_process_platform(seed=spec.job.seed):
        model = build_role_model("actor", hf_config(spec.model), ParallelConfig(distributed_optimizer=False),
                                 dtype="float32", device="cpu")
        assert model.share_embeddings_and_output_weights
        head = model.embedding.word_embeddings.weight.detach()
        norm = model.decoder.final_layernorm.weight.detach()
    digits = [ord(c) for c in "0123456789"]   # the byte tokenizer: id = byte

    def best(temperature: float) -> float:
        h = (head[digits].mean(0) * norm).clone().requires_grad_(True)
        opt = torch.optim.Adam([h], lr=0.05)
        for _ in range(300):
            p = torch.softmax((h / h.norm() * head.shape[1] ** 0.5 * norm) @ head.t() / temperature, -1)[digits].sum()
            opt.zero_grad()
            (-p).backward()
            opt.step()
        return float(p)

    assert best(1.0) < 0.1 and best(spec.rollout.temperature) > 0.85


@pytest.mark.slow
def test_lora_sft_checkpoint_merges_into_full_weights(tmp_path):
    """`mrl sft` with adapters on a Hugging Face base -> an adapters-only checkpoint -> `mrl merge`
    folds them in (merge verifies the output's logits against the adapted model) -> the merged
    model differs from the base exactly in the adapted projections; `mrl merge --format peft`
    writes a PEFT adapter directory (verified by merge against the adapted model) whose logits,
    loaded by `peft` over the base, equal the merged model's."""
    from safetensors.torch import load_file

    from mrl.merge.source import _model_tensors, resolve_checkpoint
    from tests.sft.conftest import PAIRS, make_model, sft_job, write_parquet
    from tests.sft.test_sft import mrl

    base = make_model(tmp_path / "base")
    data = write_parquet(tmp_path / "pairs.parquet", [{"prompt": p, "response": r} for p, r in PAIRS])
    job = sft_job(tmp_path, str(base), data, name="lora-sft")
    proc = mrl("sft", job, "sft.total_steps=3", "sft.lora.rank=4", "sft.lora.target_modules=[\"q_proj\",\"down_proj\"]",
               "sft.optim.lr=1e-2", "tracking.backends=[]")
    assert proc.returncode == 0, proc.stderr[-4000:]
    ckpt = tmp_path / "runs/lora-sft/checkpoints/actor"
    keys = list(_model_tensors(resolve_checkpoint(ckpt)))
    assert len(keys) == 4 and all(".lora." in k for k in keys), keys   # (q, down) x (A, B), layers stacked
    proc = mrl("merge", ckpt, tmp_path / "merged")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "; verified" in proc.stdout, proc.stdout
    merged = {k: v for f in (tmp_path / "merged").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    orig = load_file(str(base / "model.safetensors"))
    changed = sorted(k for k in orig if not torch.equal(merged[k].float(), orig[k].float()))
    assert changed == sorted(f"model.layers.{i}.{m}.weight" for i in (0, 1) for m in ("self_attn.q_proj", "mlp.down_proj"))

    proc = mrl("merge", ckpt, tmp_path / "adapter", "--format", "peft")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "PEFT adapter, 8 tensors" in proc.stdout and "; verified logits" in proc.stdout, proc.stdout
    config = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 16.0, ["q_proj", "down_proj"])
    assert config["base_model_name_or_path"] == str(base.resolve())
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, 250, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                            str(tmp_path / "adapter")).eval()(tokens).logits
        full = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()(tokens).logits
        plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()(tokens).logits
    assert (adapted - full).abs().max() <= 1e-5 and (adapted - plain).abs().max() > 1e-3


def test_bench_prints_lora_vs_full_at_qwen2_5_1_5b():
    """The arithmetic itself is checked against a built model in lora_check.py (slow tier)."""
    proc = subprocess.run([sys.executable, str(REPO / "tools/bench/lora.py")], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Qwen2.5-1.5B (1.544B params, bfloat16), rank 16" in proc.stdout
    m = re.search(r"trainable params\s+([\d,]+)\s+([\d,]+)\s+([\d.]+)%", proc.stdout)
    assert m and int(m.group(1).replace(",", "")) == 1_543_714_304 and 0 < float(m.group(3)) < 5, proc.stdout
