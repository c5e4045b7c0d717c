"""vllm engine checks, run under torchrun (external_launcher joins this world).

Usage: torchrun --nproc_per_node N vllm_checks.py MODEL_DIR TP [judge]
Each group of TP ranks forms one engine. With `judge`, rank 0 also scores a batch with a vllm
judge (`reward.judge.engine = "vllm"`) started beside its engine, and the hf judge. Checks: seeded determinism, log-probs vs a
teacher-forced transformers forward (<= 1e-4, fp32), and a weight update through the
layerwise-reload protocol (zeroed lm_head -> uniform log-probs -log V; a full stream from a
second model -> that model's outputs), the readback of the engine's weights under HF names (bit
for bit; a flipped byte named by the full verification) and the refusal of a sync that carries
only part of a fused module.
"""
from __future__ import annotations

import math
import sys
import time

import torch
import torch.distributed as dist


def main(model_dir: str, tp: int, judge: bool = False) -> None:
    from transformers import AutoModelForCausalLM

    from mrl.rollout.audit import hf_logits_fn, logprob_audit, teacher_forced_logprobs
    from mrl.rollout.types import Sampling
    from mrl.rollout.vllm_engine import VLLMEngine

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t0 = time.perf_counter()
    eng = VLLMEngine(model_dir, seed=0, dtype="float32", tensor_parallel=tp, enforce_eager=True,
                     max_model_len=256, max_num_seqs=16, bucket_mb=0.25,
                     kv_cache_memory_bytes=64 * 2**20)
    start_s = time.perf_counter() - t0
    prompts = [[1, 5, 6, 7, 8], [1, 9], [1, 300, 301]]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    # 1. seeded determinism
    s = Sampling(n=2, temperature=1.0, max_tokens=12, seed=1234)
    a, b = eng.generate(prompts, s), eng.generate(prompts, s)
    assert [r.token_ids for r in a] == [r.token_ids for r in b], "same seed, different tokens"
    assert [r.prompt_index for r in a] == [0, 0, 1, 1, 2, 2]
    assert a[0].token_ids != a[1].token_ids
    assert all(r.finish_reason == "length" and len(r.token_ids) == 12 for r in a)
    c = eng.generate(prompts, Sampling(n=2, temperature=1.0, max_tokens=12, seed=99))
    assert [r.token_ids for r in c] != [r.token_ids for r in a]

    # 2. engine log-probs == teacher-forced transformers forward (same weights)
    for samp in (s, Sampling(n=2, temperature=0.7, top_p=0.8, top_k=50, max_tokens=12, seed=5),
                 Sampling(n=1, temperature=0.0, max_tokens=12)):
        resp = eng.generate(prompts, samp)
        audit = logprob_audit(*_order(teacher_forced_logprobs(hf_logits_fn(hf), prompts, resp, samp)))
        print(f"rank {rank} audit {samp.temperature}/{samp.top_p}: {audit}", flush=True)
        assert audit["rollout/logprob_abs_diff_max"] <= 1e-4, audit

    # 3. weight updates: zero lm_head -> uniform; then a full stream of another model
    V = hf.config.vocab_size
    assert eng.update_weights([("lm_head.weight", torch.zeros(V, hf.config.hidden_size))], partial=True) == 1
    for r in eng.generate(prompts, Sampling(n=1, temperature=1.0, max_tokens=6, seed=0)):
        assert max(abs(lp + math.log(V)) for lp in r.logprobs) <= 1e-5, r.logprobs
    torch.manual_seed(1)
    other = AutoModelForCausalLM.from_config(hf.config, dtype=torch.float32)
    n = eng.update_weights((k, v.detach().clone()) for k, v in other.state_dict().items())
    assert n == len(other.state_dict())
    resp = eng.generate(prompts, s)
    audit = logprob_audit(*_order(teacher_forced_logprobs(hf_logits_fn(other), prompts, resp, s)))
    assert audit["rollout/logprob_abs_diff_max"] <= 1e-4, audit
    readback_s = _readback_checks(eng, other, rank)

    # 4. EOS ends a response although the engine has no tokenizer (eos from generation_config)
    first = eng.generate([[1, 5]], Sampling(n=1, temperature=0.0, max_tokens=4))[0].token_ids[0]
    eng.eos_token_ids = (first,)
    stopped = eng.generate([[1, 5]], Sampling(n=1, temperature=0.0, max_tokens=4))[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop", stopped
    assert len(eng.generate([[1, 5]], Sampling(temperature=0.0, max_tokens=4, ignore_eos=True))[0].token_ids) == 4

    eng.sleep()
    eng.wake()
    assert eng.generate(prompts[:1], Sampling(max_tokens=2))
    if judge and rank == 0:
        # 5. a vllm judge beside this in-process (external_launcher) engine: its own engine processes
        judge_s = _judge_beside_the_engine()
        after = eng.generate(prompts, s)   # the rollout engine is untouched by the judge's start
        assert [r.token_ids for r in after] == [r.token_ids for r in resp], "rollout engine changed by the judge"
        print(f"rank {rank} judge ok: {judge_s}", flush=True)
    eng.shutdown()
    print(f"rank {rank} ok: engine start {start_s:.1f}s, readback of every tensor {readback_s:.3f}s, "
          f"total {time.perf_counter() - t0:.1f}s", flush=True)


def _readback_checks(eng, other, rank: int) -> float:
    """The engine's weights read back under HF names (q/k/v and gate/up split out of the fused
    parameters, TP pieces gathered) are the loaded tensors bit for bit; the full verification
    names a tensor with one flipped byte; a sync carrying part of a fused module is refused."""
    from mrl.rollout.weight_channel import WeightReceiver
    from mrl.weights.verify import WeightSyncError, checksum

    state = {k: v.detach().clone() for k, v in other.state_dict().items()}
    t0 = time.perf_counter()
    held = dict(eng.held_weights(sorted(state)))
    seconds = time.perf_counter() - t0
    assert sorted(held) == sorted(state)
    for name, t in state.items():
        assert torch.equal(held[name].view(torch.int32), t.view(torch.int32)), f"rank {rank}: {name} read back differs"

    receiver = WeightReceiver(eng, f"test (rank {rank})")
    expected = {k: checksum(v) for k, v in state.items()}
    receiver.verify(expected, {k: v.dtype for k, v in state.items()}, version=3)
    victim = "model.layers.1.self_attn.k_proj.weight"
    flipped = state[victim].clone()
    flipped.view(-1).view(torch.uint8)[1234] ^= 0x10
    unit = [n for n in state if eng.load_unit(n) == eng.load_unit(victim)]
    assert sorted(unit) == sorted(f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"), unit
    eng.update_weights([(n, flipped if n == victim else state[n]) for n in unit], partial=True)
    try:
        receiver.verify(expected, {}, version=3)
    except WeightSyncError as e:
        assert str(e) == (f"weight verification: {victim} at engine group test (rank {rank}) differs from the "
                          "trainer's version 3"), e
    else:
        raise AssertionError(f"rank {rank}: a flipped byte in the engine's {victim} went unnoticed")

    try:   # q alone: vLLM would rebuild qkv_proj with uninitialised k and v
        eng.update_weights([("model.layers.0.self_attn.q_proj.weight", state["model.layers.0.self_attn.q_proj.weight"])],
                           partial=True)
    except RuntimeError as e:
        assert "loaded only part of model.layers.0.self_attn.qkv_proj" in str(e), e
    else:
        raise AssertionError(f"rank {rank}: a partial load of a fused module was accepted")
    eng.update_weights(state.items())
    receiver.verify(expected, {}, version=3)
    return seconds


def _judge_beside_the_engine() -> str:
    """Score 8 responses with the builtin tiny judge on vllm and on hf (same seeded weights, fp32,
    greedy): the same answers, each parsed or counted as a reward error."""
    from mrl.reward.compose import Rewarder, RewardSample
    from mrl.reward.config import JudgeConfig, RewardConfig

    samples = [RewardSample(i, f"What is {i} + 1?", f"It is {i + 1}.", str(i + 1)) for i in range(8)]
    results, seconds = {}, {}
    for engine in ("vllm", "hf"):
        extra = {"engine_kwargs": {"enforce_eager": True}} if engine == "vllm" else {}
        cfg = RewardConfig(judge=JudgeConfig(model="builtin:tiny-qwen2", max_tokens=6, engine=engine, **extra), workers=1)
        t = time.perf_counter()
        with Rewarder.from_config(cfg) as rewarder:
            start = time.perf_counter() - t
            t = time.perf_counter()
            results[engine] = rewarder.score(samples)
            seconds[engine] = (start, time.perf_counter() - t)
    vllm, hf = results["vllm"], results["hf"]
    counted = sum(v for k, v in vllm.stats.items() if k.startswith("reward/judge/errors/"))
    assert counted + sum(not math.isnan(v) for v in vllm.source_scores["judge"]) == 8, vllm.stats
    assert [(e.kind, e.message) for e in vllm.errors] == [(e.kind, e.message) for e in hf.errors], (vllm.errors, hf.errors)
    assert all(a == b or math.isnan(a) and math.isnan(b)
               for a, b in zip(vllm.source_scores["judge"], hf.source_scores["judge"], strict=True))
    return ", ".join(f"{k} start {a:.1f}s, 8 scored in {b:.2f}s" for k, (a, b) in seconds.items())


def _order(triple):
    trainer, rollout, mask = triple
    return rollout, trainer, mask


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), judge=sys.argv[3:] == ["judge"])
